"""One loader per file format. Each reads a config cheaply (`read_config`) and loads weights
renamed to Hugging Face names (`load`)."""
