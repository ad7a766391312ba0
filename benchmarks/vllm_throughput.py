"""Run inside benchmarks/.peers/vllm-venv: vLLM's offline throughput on a workload file written
by benchmarks/peers.py (prompt token ids and output lengths, EOS ignored), printed as JSON.

    vllm-venv/bin/python benchmarks/vllm_throughput.py MODEL_DIR WORKLOAD.json DTYPE THREADS
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    model, workload, dtype, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")  # its OpenMP threads, one a core
    os.environ["OMP_NUM_THREADS"] = str(threads)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    w = json.load(open(workload))
    llm = LLM(model=model, dtype=dtype, max_model_len=1024, seed=0, max_num_seqs=len(w["prompts"]))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in w["output_lens"]]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT", json.dumps({"elapsed_s": elapsed, "output_tokens": generated, "output_tokens_per_s": generated / elapsed}))


if __name__ == "__main__":
    main()
