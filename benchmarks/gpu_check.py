"""GPU check of kvpack's Triton kernels: correctness at real sizes, then decode speed vs dense attention.

On one CUDA device (Llama-8B head shape: 8 KV heads, 32 query heads, d = 128):

1. Correctness: for PuzzleKV (post-RoPE, pre-RoPE, INT4) and AnchorKV stores of 8K tokens, the
   Triton path's output vs the PyTorch path's on the same store (max abs error, bf16 scale), for a
   decode step and for a 16-query chunk (query rows in several of the kernels' row blocks), and a
   decode step's whole attention (``attend``, ending in the chunk-attention kernel).
2. Kernel resources: registers, spills and shared memory of each kernel as compiled for the device.
3. Decode: one decode step's attention over a layer at contexts 16K, 32K, 64K, 128K and batch 1 and
   8 — the Triton kernel over each row's PuzzleKV / AnchorKV store vs SDPA (FlashAttention backend
   where available) over the dense bf16 cache, every row with its own tensors (copies) — printed as
   one table: time ratios (kvpack ÷ dense, medians of CUDA-event timings) launched eagerly and
   replayed from a CUDA graph, bytes ratio (bytes the stores hold ÷ dense bytes), achieved GB/s
   (bytes read, RoPE table rows included, ÷ time) and the fraction of the device's copy bandwidth
   measured in the same run.

4. Decode steps end to end: attend + append per token over one layer at the first context (96
   tokens; a completed page's factorization included), eager, vs SDPA over a preallocated dense
   cache written in place — the per-token cost the PuzzleKV paper reports as TPOT (+0.18%).

Prints the elapsed time after each context. The issue's limit, 8 minutes on an H200, is enforced
by a wall-clock deadline (``--deadline-s``, 420 s after start-up by default): a measurement whose
predicted duration (the same configuration's at the previous context, scaled by the context) would
end past it is not started, and a watchdog interrupts whatever still runs when it passes; then the
script lists what it did not measure and exits normally, so a cut-short run still reports every
configuration at the contexts it reached (32K first). How long a full run takes on an H200 is an
estimate until one runs (stores are built once per context; batch rows copy that store).
``--cpu-smoke`` runs the same code on CPU through the Triton interpreter at tiny sizes, to check the
script itself where there is no GPU (its timings mean nothing).

Usage: python benchmarks/gpu_check.py [--contexts 32768,65536,131072,16384] [--deadline-s 420]
       [--sections correctness,decode,steps] [--batches 1,8] [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import signal
import statistics
import sys
import time

if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from kvpack.attention.softmax_merge import dense_partial, finalize, group_queries, merge_partials  # noqa: E402
from kvpack.ops.rope import LlamaRotary, RotaryTable  # noqa: E402
from kvpack.resident import LayerLayout, get_resident_method  # noqa: E402


def _timer(fn, device, repeats=20, warmup=3) -> float:
    if device.type != "cuda":  # the interpreter's timings mean nothing: one warm-up, one timed call
        warmup, repeats = 1, 1
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        times = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _copy_bandwidth(device) -> float:
    """Achieved device-to-device copy bandwidth, bytes/s (read + write)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / _timer(lambda: dst.copy_(src), device, repeats=10)


def build_store(method: str, cfg: dict, kv_heads: int, group: int, d: int, seq: int, device, seed: int = 0):
    """A store filled with ``seq`` synthetic tokens (clustered keys with a decaying spectrum)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    layout = LayerLayout(layer_idx=0, kv_heads=kv_heads, q_heads=kv_heads * group, head_dim=d,
                         model_dtype=torch.bfloat16, rope=RotaryTable(LlamaRotary(d).to(device), d))
    store = get_resident_method(method, **cfg).new_store(layout)
    centers = torch.randn(kv_heads, 64, d, generator=g)
    pick = torch.randint(0, 64, (kv_heads, seq), generator=g)
    k = (torch.gather(centers, 1, pick[..., None].expand(-1, -1, d)) + 0.3 * torch.randn(kv_heads, seq, d, generator=g))
    v = torch.randn(kv_heads, seq, d, generator=g)
    k, v = k.to(device, torch.bfloat16), v.to(device, torch.bfloat16)
    # Observation queries: AnchorKV scores with the last W queries; the rest only need shapes.
    q = torch.randn(kv_heads * group, seq, d, generator=g).to(device, torch.bfloat16)
    store.scaling = d ** -0.5
    out = torch.zeros_like(q)
    if method.startswith("anchor"):  # exact outputs of the observation window (what compression scores with)
        w = cfg.get("window", 32)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[None, :, -w:].float(), k[None].float(), v[None].float(), scale=d ** -0.5, enable_gqa=True)[0]
        out[:, -w:] = ref.to(out.dtype)
    store.append(k, v, q=q, out=out)
    return store, k, v


def _store_output(store, qg, scaling, backend: str):
    """Normalised attention of ``qg`` over everything the store holds, through ``backend``."""
    store.config = dataclasses.replace(store.config, attention_backend=backend)  # configs are frozen
    states = store.stored_partials(qg, scaling)
    tail = store.chunk_tail()  # dense tokens the chunk step reads in place (AnchorKV's tail)
    if tail is not None and tail[0].shape[1]:
        states.append(dense_partial(qg, tail[0].to(qg.dtype), tail[1].to(qg.dtype), scaling))
    return finalize(merge_partials(states))


def _decode_steps(store, steps: int, device, seed: int = 1) -> float:
    """Seconds per decode step of one layer through the store (attend, then append: the incremental
    compression a page completion triggers included), averaged over ``steps`` tokens."""
    lay = store.layout
    g = torch.Generator(device="cpu").manual_seed(seed)
    toks = [(torch.randn(lay.q_heads, 1, lay.head_dim, generator=g).to(device, torch.bfloat16),
             torch.randn(lay.kv_heads, 1, lay.head_dim, generator=g).to(device, torch.bfloat16),
             torch.randn(lay.kv_heads, 1, lay.head_dim, generator=g).to(device, torch.bfloat16)) for _ in range(steps)]
    _sync(device)
    start = time.perf_counter()
    for q, k, v in toks:
        out = store.attend(q, k, v, lay.head_dim ** -0.5)
        store.append(k, v, q, out)
    _sync(device)
    return (time.perf_counter() - start) / steps


def _dense_decode_steps(k, v, G: int, steps: int, device) -> float:
    """The same for a dense bf16 cache preallocated for the new tokens (a static cache: each step
    writes its token in place and attends over the filled prefix with SDPA)."""
    H, T, d = k.shape
    kbuf = torch.empty(H, T + steps, d, device=device, dtype=k.dtype)
    vbuf = torch.empty_like(kbuf)
    kbuf[:, :T], vbuf[:, :T] = k, v
    q = torch.randn(1, H * G, 1, d, device=device, dtype=k.dtype)
    kn, vn = torch.randn(H, 1, d, device=device, dtype=k.dtype), torch.randn(H, 1, d, device=device, dtype=k.dtype)
    _sync(device)
    start = time.perf_counter()
    for t in range(T, T + steps):
        kbuf[:, t:t + 1], vbuf[:, t:t + 1] = kn, vn
        torch.nn.functional.scaled_dot_product_attention(q, kbuf[None, :, :t + 1], vbuf[None, :, :t + 1],
                                                         scale=d ** -0.5, enable_gqa=True)
    _sync(device)
    return (time.perf_counter() - start) / steps


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _graph_timer(fn, device, repeats=20) -> float | None:
    """Median seconds of replaying ``fn``'s launches from one CUDA graph (None on CPU or when the
    capture fails: then only the eager time is reported)."""
    if device.type != "cuda":
        return None
    try:
        fn()  # compile and pick pipelining depths outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # report, do not invent a figure
        print(f"  (CUDA graph capture failed: {type(e).__name__}: {str(e)[:120]})")
        return None
    return _timer(graph.replay, device, repeats=repeats)


def _ms(t: float | None) -> str:
    return "n/a" if t is None else f"{t * 1e3:.3f}"


def _rope_bytes_read(store) -> int:
    """Bytes of the RoPE table rows one decode step reads for the positions whose keys are rotated
    in-kernel (pre-RoPE PuzzleKV pages, AnchorKV segments); batch rows share the table."""
    rope_rows = 0
    if getattr(store, "segment_spans", None):
        rope_rows = store.n_compressed
    elif getattr(store.config, "key_rope", "post") == "pre":
        rope_rows = store.n_pages * store.config.page_size
    table_width = store.layout.head_dim // 2 if store.layout.rope is not None and store.layout.rope.halves_equal \
        else store.layout.head_dim
    return rope_rows * table_width * 4 * 2  # fp32 cos and sin


def _print_resources(compiled_by: dict[str, list]) -> None:
    """Registers, spills and shared memory of each kernel as compiled for this device;
    ``compiled_by``: label -> the ``_launch.compiled_kernels()`` keys its launches added."""
    from kvpack.attention.triton import _launch

    compiled = _launch.compiled_kernels()
    for label, keys in compiled_by.items():
        for key in keys:
            stages, kernel = compiled[key]
            regs, spills = getattr(kernel, "n_regs", "?"), getattr(kernel, "n_spills", "?")
            shared = getattr(getattr(kernel, "metadata", None), "shared", "?")
            print(f"  {label:<26} {key[0]}: {stages} stages, {regs} registers, {spills} spills, {shared} B shared")


SECTIONS = ("correctness", "decode", "steps")  # in the order they run

CHUNK_QUERIES = 16  # the correctness section's multi-query chunk (a prefill over the stored history)

CONFIGS = [
    ("puzzle", {"budget": 0.6}, "puzzle P=32 budget 0.6"),
    ("puzzle", {"budget": 0.6, "key_rope": "pre"}, "puzzle pre-RoPE 0.6"),
    ("puzzle", {"page_size": 64, "budget": 0.6, "int4": True}, "puzzle P=64 INT4 0.6"),
    ("anchor", {"budget": 0.1}, "anchor theta 0.1"),
    ("anchor_plus", {"budget": 0.3, "above_saturation": "residual4"}, "anchor_plus 4-bit tier 0.3"),
    ("puzzle_plus", {"budget": 0.5, "int4": False, "key_rope": "post"}, "puzzle_plus P=64 0.5"),
    ("puzzle_plus", {"budget": 0.5, "key_rope": "pre", "int4": True}, "puzzle_plus pre-RoPE INT4 0.5"),
]


class DeadlineReached(BaseException):
    """Raised by :class:`Deadline`'s watchdog when the run's wall-clock limit passes (a BaseException,
    like KeyboardInterrupt, so that no ``except Exception`` on the way — the CUDA-graph capture's —
    swallows it)."""


class Deadline:
    """The run's wall-clock limit (the issue's "finish within 8 minutes on one H200").

    Two guards: :meth:`fits` keeps a measurement from starting when its predicted duration would end
    past the limit, and :meth:`armed` interrupts whatever still runs when it passes (SIGALRM raises
    :class:`DeadlineReached` between Python bytecodes: one long native call — a kernel compile, a
    batched eigh — finishes first, seconds at most).
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()

    def elapsed(self) -> float:
        return self.seconds - self.left()

    def fits(self, predicted_s: float) -> bool:
        return predicted_s < self.left()

    @contextlib.contextmanager
    def armed(self):
        def on_alarm(signum, frame):
            raise DeadlineReached

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, max(self.left(), 1e-3))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default=None,
                        help="comma-separated token counts (default 32768,65536,131072,16384; 1024 with --cpu-smoke)")
    parser.add_argument("--deadline-s", type=float, default=420.0,
                        help="wall-clock limit after start-up: nothing predicted to end past it starts, and "
                             "what still runs when it passes is interrupted (listed as not measured)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"which of {', '.join(SECTIONS)} to run (comma-separated; all by default)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU through the Triton interpreter")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        device, H, G, d = torch.device("cpu"), 2, 2, 32
        contexts, check_len = [int(c) for c in (args.contexts or "1024").split(",")], 1024
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; run with --cpu-smoke to check the script on CPU", file=sys.stderr)
            return 2
        device, H, G, d = torch.device("cuda"), 8, 4, 128
        contexts, check_len = [int(c) for c in (args.contexts or "32768,65536,131072,16384").split(",")], 8192
    batches = [int(b) for b in args.batches.split(",")]
    sections = args.sections.split(",")
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    deadline = Deadline(args.deadline_s)
    # Every measurement, in the order it runs; each leaves the list when done, and whatever is left
    # when the deadline passes is printed as not measured.
    planned = {"correctness": [f"correctness: {label}" for _, _, label in CONFIGS],
               "decode": [f"decode: {label} at {seq}" for seq in contexts for _, _, label in CONFIGS],
               "steps": [f"decode steps: {label} at {contexts[0]}" for _, _, label in CONFIGS]}
    pending = [unit for section in SECTIONS if section in sections for unit in planned[section]]
    run = Run(device, H, G, d, deadline, pending)
    try:
        with deadline.armed():
            run.header()
            if "correctness" in sections:
                run.correctness(check_len)
            if "decode" in sections:
                run.decode_table(contexts, batches)
            if "steps" in sections:
                run.decode_steps_table(contexts[0], 8 if args.cpu_smoke else 96)
    except DeadlineReached:
        print(f"\n  (interrupted: the {args.deadline_s:.0f} s deadline passed)")
    if pending:
        print(f"\n## NOT MEASURED (deadline {args.deadline_s:.0f} s): {'; '.join(pending)}")
    print(f"  (finished at {deadline.elapsed():.0f} s)")
    return 0


class Run:
    """One run's device, head shape and deadline; each section method removes its measurements from
    ``pending`` as it prints them."""

    def __init__(self, device, H: int, G: int, d: int, deadline: Deadline, pending: list[str]):
        self.device, self.H, self.G, self.d = device, H, G, d
        self.deadline, self.pending = deadline, pending
        self.scaling = d ** -0.5
        self.bandwidth = None
        self.compiled_by = {}  # label -> the kernels its Triton launches compiled

    def header(self) -> None:
        name = torch.cuda.get_device_name() if self.device.type == "cuda" else "CPU (Triton interpreter)"
        self.bandwidth = _copy_bandwidth(self.device)
        print(f"# gpu_check on {name}, torch {torch.__version__}; copy bandwidth {self.bandwidth / 1e9:.0f} GB/s")

    def correctness(self, check_len: int) -> None:
        """Triton vs PyTorch on the same stores of ``check_len`` tokens; then the compiled kernels'
        resources."""
        from kvpack.attention.triton import _launch

        H, G, d, device, scaling = self.H, self.G, self.d, self.device, self.scaling
        print("\n## correctness: Triton vs PyTorch path on the same store (bf16 storage; a decode step, a "
              f"{CHUNK_QUERIES}-query chunk over the stored history: {CHUNK_QUERIES * G} rows per KV head, several "
              "row blocks; a decode step's whole attend)")
        for method, cfg, label in CONFIGS:
            store, _, _ = build_store(method, {**cfg, "attention_backend": "torch"}, H, G, d, check_len, device)
            before = set(_launch.compiled_kernels())
            errors = []
            for n_q in (1, CHUNK_QUERIES):
                qg = group_queries(torch.randn(H * G, n_q, d, device=device), H)
                ref = _store_output(store, qg, scaling, "torch")
                got = _store_output(store, qg, scaling, "triton")
                errors.append((got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6))
            # A whole decode step's attention (attend: the stored part and the new token, whose end is
            # the chunk-attention kernel on the Triton path); attend does not change the store.
            q1 = torch.randn(H * G, 1, d, device=device)  # fp32: attend returns the queries' dtype
            k1, v1 = (torch.randn(H, 1, d, device=device) for _ in range(2))
            outs = []
            for backend in ("torch", "triton"):
                store.config = dataclasses.replace(store.config, attention_backend=backend)
                outs.append(store.attend(q1, k1, v1, scaling))
            errors.append((outs[1] - outs[0]).abs().max().item() / max(outs[0].abs().max().item(), 1e-6))
            self.compiled_by[label] = [key for key in _launch.compiled_kernels() if key not in before]
            verdict = "ok" if max(errors) < 2e-2 else "MISMATCH"
            print(f"  {label:<26} max |err| / max |ref| = {errors[0]:.2e} (decode), {errors[1]:.2e} (chunk), "
                  f"{errors[2]:.2e} (attend)  {verdict}")
            self.pending.remove(f"correctness: {label}")
        print("\n## kernel resources (compiled for this device; registers and spills per thread)")
        if device.type == "cuda":
            _print_resources(self.compiled_by)

    def decode_table(self, contexts: list[int], batches: list[int]) -> None:
        """One decode step's attention over a layer, kvpack's Triton path vs SDPA over the dense cache."""
        H, G, d, device, scaling = self.H, self.G, self.d, self.device, self.scaling
        print("\n## decode attention, one layer (kvpack Triton vs SDPA over the dense bf16 cache)")
        print("Every batch row holds its own tensors (dense: distinct K/V copies; kvpack: a copy of the store).")
        print("eager = each call launched from Python; graph = the same calls replayed from one CUDA graph "
              "(launch overhead removed; n/a if capture failed).")
        print("| config | context | batch | dense ms eager | kvpack ms eager | ratio eager | dense ms graph "
              "| kvpack ms graph | ratio graph | bytes ratio | kvpack GB/s | % of copy BW |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        last = {}  # label -> (context, seconds) of its last measurement, to predict the next one's
        # Context-major, in the order given (32K first by default: the goals' context), so that a run
        # cut short by the deadline still has every configuration at the contexts it reached.
        for seq in contexts:
            for method, cfg, label in CONFIGS:
                if label in last and not self.deadline.fits(last[label][1] * seq / last[label][0]):
                    continue  # stays pending: predicted to end past the deadline
                started = time.perf_counter()
                store, k, v = build_store(method, {**cfg, "attention_backend": "triton"}, H, G, d, seq, device)
                dense_bytes = 2 * k.numel() * k.element_size()
                for batch in batches:
                    # Copies own their tensors; they share the layout (one RoPE table per model, as in serving).
                    rows = [store] + [copy.deepcopy(store, {id(store.layout): store.layout}) for _ in range(batch - 1)]
                    kd = torch.stack([k] + [k.clone() for _ in range(batch - 1)])
                    vd = torch.stack([v] + [v.clone() for _ in range(batch - 1)])
                    q = torch.randn(batch, H * G, 1, d, device=device, dtype=torch.bfloat16)
                    qgs = [group_queries(q[b].float(), H) for b in range(batch)]

                    # The closures run only inside this iteration, before the `del` below.
                    def dense():
                        return torch.nn.functional.scaled_dot_product_attention(q, kd, vd, scale=scaling,  # noqa: F821
                                                                                enable_gqa=True)

                    def packed():
                        return [_store_output(r, qg, scaling, "triton") for r, qg in zip(rows, qgs)]  # noqa: F821

                    eager_d, eager_k = _timer(dense, device), _timer(packed, device)
                    graph_d, graph_k = _graph_timer(dense, device), _graph_timer(packed, device)
                    moved = batch * store.nbytes() + _rope_bytes_read(store)
                    ratio_g = f"{graph_k / graph_d:.3f}" if graph_d and graph_k else "n/a"
                    t_best = graph_k or eager_k
                    print(f"| {label} | {seq} | {batch} | {eager_d * 1e3:.3f} | {eager_k * 1e3:.3f} | "
                          f"{eager_k / eager_d:.3f} | {_ms(graph_d)} | {_ms(graph_k)} | {ratio_g} "
                          f"| {store.nbytes() / dense_bytes:.3f} | {moved / t_best / 1e9:.0f} "
                          f"| {100 * moved / t_best / self.bandwidth:.0f}% |")
                    del rows, kd, vd
                del store, k, v
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                last[label] = (seq, time.perf_counter() - started)
                self.pending.remove(f"decode: {label} at {seq}")
            print(f"  (context {seq}: done at {self.deadline.elapsed():.0f} s)")

    def decode_steps_table(self, seq: int, steps: int) -> None:
        """Whole decode steps of one layer (attend + append), kvpack vs a dense static cache."""
        H, G, d, device = self.H, self.G, self.d, self.device
        print(f"\n## decode steps end to end, one layer, batch 1, {seq} tokens + {steps} decoded")
        print("attend + append per token (the incremental compression of completed pages included; "
              "check_finite=false, eager) vs SDPA over a preallocated dense bf16 cache written in place.")
        print("| config | dense ms/step | kvpack ms/step | ratio |")
        print("|---|---|---|---|")
        for method, cfg, label in CONFIGS:
            store, k, v = build_store(method, {**cfg, "attention_backend": "triton", "check_finite": False},
                                      H, G, d, seq, device)
            _decode_steps(store, 2, device, seed=2)  # compile, pick pipelining depths
            t_kv = _decode_steps(store, steps, device)
            t_dense = _dense_decode_steps(k, v, G, steps, device)
            print(f"| {label} | {t_dense * 1e3:.3f} | {t_kv * 1e3:.3f} | {t_kv / t_dense:.3f} |")
            del store, k, v
            self.pending.remove(f"decode steps: {label} at {seq}")


if __name__ == "__main__":
    sys.exit(main())
