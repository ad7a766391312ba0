"""What growing past one process costs here, and what it would gain on real hardware.

    python benchmarks/distributed.py [--out results.json]

On a 2-core machine more processes cannot run faster, so this measures the overheads:
  - tensor parallelism: per decode step, the step messages rank 0 sends (bytes, time) and the
    all-reduces (count, bytes, time including waiting for the slowest rank), TP = 1, 2 (stories260K)
    and 3 (SmolLM2: 9 heads, 3 KV heads), gloo, one thread per rank;
  - disaggregation: handover bytes and time per prompt token (SmolLM2, gloo send/recv on loopback);
  - the router: time a request spends in it (routed vs direct, same replica, one token);
and projects them to TP = 8 on one GPU node and a prefill/decode split across two nodes from the
published bandwidths below.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STORIES = str(REPO.parent / "shared" / "models" / "stories260K")
SMOLLM2 = "SmolLM2-135M-Instruct"

# published figures used by the projection
NVLINK_BUS_BYTES_S = 450e9  # H100 SXM NVLink 4: 900 GB/s bidirectional, 450 GB/s each way
ALL_REDUCE_LATENCY_S = 15e-6  # NCCL small-message all-reduce on 8 GPUs of one node (order of)
HBM_BYTES_S = 3.35e12  # H100 SXM HBM3
IB_BYTES_S = 50e9  # one 400 Gb/s InfiniBand NDR link
H100_BF16_FLOPS = 990e12 * 0.5  # dense bf16, at half of peak
LLAMA70B = dict(layers=80, hidden=8192, kv_heads=8, head_dim=128, params=70.6e9)


def tp_figures(model: str, tp: int, prompts: list, max_tokens: int) -> dict:
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm import LLM
    llm = LLM(model, tensor_parallel_size=tp, max_num_seqs=len(prompts))
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2))  # warm up
    steps0, t0 = engine.num_steps, time.perf_counter()
    comm0 = (engine.comm.num_all_reduces, engine.comm.all_reduce_bytes, engine.comm.all_reduce_s)
    w = engine.workers
    msg0 = (w.num_messages, w.message_bytes, w.message_s) if w else (0, 0, 0.0)
    llm.generate(prompts, params)
    elapsed, steps = time.perf_counter() - t0, engine.num_steps - steps0
    comm = [b - a for a, b in zip(comm0, (engine.comm.num_all_reduces, engine.comm.all_reduce_bytes,
                                          engine.comm.all_reduce_s))]
    msg = [b - a for a, b in zip(msg0, (w.num_messages, w.message_bytes, w.message_s) if w else (0, 0, 0.0))]
    engine.close()
    return dict(model=engine.model_config.name, tp=tp, steps=steps, step_ms=1e3 * elapsed / steps,
                all_reduces_per_step=comm[0] / steps, all_reduce_bytes_per_step=comm[1] / steps,
                all_reduce_ms_per_step=1e3 * comm[2] / steps, messages_per_step=msg[0] / steps,
                message_bytes_per_step=msg[1] / steps, message_ms_per_step=1e3 * msg[2] / steps)


def handover_figures(num_prompts: int, prompt_tokens: int) -> dict:
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.distributed.disagg import DisaggregatedLLM
    llm = DisaggregatedLLM(SMOLLM2, max_model_len=2048)
    prompts = [[(37 * i + 11 * j) % 40000 + 100 for j in range(prompt_tokens)] for i in range(num_prompts)]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm up
    c = llm.connector
    n0, b0, s0 = c.num_received, c.bytes_received, c.receive_s
    sent0 = llm.prefill_stats()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4))
    sent = llm.prefill_stats()
    tokens = num_prompts * prompt_tokens
    out = dict(prompts=c.num_received - n0, prompt_tokens=tokens, bytes_per_token=(c.bytes_received - b0) / tokens,
               receive_us_per_token=1e6 * (c.receive_s - s0) / tokens,
               send_us_per_token=1e6 * (sent["send_s"] - sent0["send_s"]) / tokens,
               gbytes_s=(c.bytes_received - b0) / max(c.receive_s - s0, 1e-9) / 1e9,
               decode_prompt_tokens_computed=llm.engine.num_prompt_tokens_computed)
    llm.close()
    return out


def router_figures(repeats: int) -> dict:
    import httpx
    from tests.server.conftest import RunningServer, free_port
    from kvserve.server.router import Router, create_router_app, wait_healthy
    exe = os.path.join(os.path.dirname(sys.executable), "kvserve")
    port = free_port()
    proc = subprocess.Popen([exe, "serve", "--model", STORIES, "--port", str(port), "--num-blocks", "256"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy([url], 120)
        with RunningServer(create_router_app(Router([url])), None) as front:
            body = {"prompt": "Once upon a time, there was a little girl", "max_tokens": 1, "temperature": 0}
            times: dict[str, list[float]] = {"direct": [], "routed": []}
            with httpx.Client(timeout=30) as client:
                for i in range(repeats):  # interleaved, medians
                    for name, target in (("direct", url), ("routed", front.url)):
                        t0 = time.perf_counter()
                        assert client.post(target + "/v1/completions", json=body).status_code == 200
                        times[name].append(time.perf_counter() - t0)
        direct, routed = statistics.median(times["direct"]), statistics.median(times["routed"])
        return dict(direct_ms=1e3 * direct, routed_ms=1e3 * routed, router_overhead_ms=1e3 * (routed - direct))
    finally:
        proc.kill()
        proc.wait()


def projection(handover: dict) -> dict:
    """TP = 8 on one H100 node and a prefill/decode split over two nodes, Llama-70B-like, bf16."""
    m, batch, tp = LLAMA70B, 64, 8
    all_reduces = 2 * m["layers"]
    payload = batch * m["hidden"] * 2  # bytes each all-reduce sums, decode batch of 64
    ring = 2 * (tp - 1) / tp * payload / NVLINK_BUS_BYTES_S
    comm_s = all_reduces * (ALL_REDUCE_LATENCY_S + ring)
    weights_s = m["params"] * 2 / tp / HBM_BYTES_S  # each GPU streams its 1/8 of the weights a step
    kv_per_token = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * 2
    prompt = 4096
    handover_s = kv_per_token * prompt / IB_BYTES_S
    prefill_s = 2 * m["params"] * prompt / (tp * H100_BF16_FLOPS)
    return dict(tp8_decode_step_weights_ms=1e3 * weights_s, tp8_decode_step_comm_ms=1e3 * comm_s,
                tp8_comm_share=comm_s / (comm_s + weights_s), kv_bytes_per_token=kv_per_token,
                handover_4k_prompt_ms=1e3 * handover_s, prefill_4k_prompt_ms=1e3 * prefill_s,
                handover_share_of_prefill=handover_s / prefill_s,
                measured_kvserve_handover_gbytes_s=handover["gbytes_s"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--router-repeats", type=int, default=40)
    a = p.parse_args()
    stories_prompts = [[1] + [(5 * i + j) % 400 + 50 for j in range(24)] for i in range(4)]
    from kvserve.models.registry import load_weights
    tok = load_weights(SMOLLM2).tokenizer
    smol_prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in
                    ("What is the capital of France?", "Write a haiku about the sea.", "Name three colours.")]
    results: dict = {"tp": []}
    for model, tps, prompts, n in ((STORIES, (1, 2), stories_prompts, 64), (SMOLLM2, (1, 3), smol_prompts, 24)):
        for tp in tps:
            r = tp_figures(model, tp, prompts, n)
            results["tp"].append(r)
            print(f"{r['model']:>24} TP={tp}: {r['step_ms']:6.2f} ms/step | all-reduce {r['all_reduces_per_step']:.0f}/step "
                  f"{r['all_reduce_bytes_per_step'] / 1024:7.1f} KiB {r['all_reduce_ms_per_step']:6.2f} ms | "
                  f"step messages {r['messages_per_step']:.1f}/step {r['message_bytes_per_step'] / 1024:5.1f} KiB "
                  f"{r['message_ms_per_step']:5.3f} ms", flush=True)
    h = results["handover"] = handover_figures(4, 512)
    print(f"handover (SmolLM2 fp32 cache, gloo loopback): {h['bytes_per_token']:,.0f} B/token, receive "
          f"{h['receive_us_per_token']:.1f} us/token, send {h['send_us_per_token']:.1f} us/token "
          f"({h['gbytes_s']:.2f} GB/s); decode side computed {h['decode_prompt_tokens_computed']} prompt tokens",
          flush=True)
    r = results["router"] = router_figures(a.router_repeats)
    print(f"router: direct {r['direct_ms']:.2f} ms, routed {r['routed_ms']:.2f} ms per request "
          f"(overhead {r['router_overhead_ms']:.2f} ms, median of {a.router_repeats})")
    pr = results["projection"] = projection(h)
    print(f"projection, Llama-70B-like bf16 on 8 x H100 (NVLink): decode step of batch 64 streams weights in "
          f"{pr['tp8_decode_step_weights_ms']:.2f} ms, all-reduces take {pr['tp8_decode_step_comm_ms']:.2f} ms "
          f"({100 * pr['tp8_comm_share']:.0f}% of the step)")
    print(f"projection, prefill/decode over 400 Gb/s InfiniBand: {pr['kv_bytes_per_token'] / 1024:.0f} KiB of K/V per "
          f"token, a 4k-token prompt hands over in {pr['handover_4k_prompt_ms']:.0f} ms against "
          f"{pr['prefill_4k_prompt_ms']:.0f} ms to prefill it ({100 * pr['handover_share_of_prefill']:.0f}%)")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
