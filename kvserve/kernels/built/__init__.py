"""The compiled kernels, one module a (kernel, level), built here by setup.py at install
(kvserve.kernels.levels lists them; report.json says which exist and why any does not)."""
