"""Prefill (extend) attention of one layer, a long prompt in SGLang's chunks: part of ``bench_kernels.py``.

    python scripts/bench_kernels.py --out OUT        # writes it as a section of bench_kernels.md/.json

SGLang prefills a long prompt in chunks (``--chunked-prefill-size``: 8192 on an H200), so a 32k prompt is
four extend passes over cached prefixes of 0, 8k, 16k and 24k tokens; in every layer each chunk's tokens
attend to the whole cached prefix and causally to each other.  Unlike decode this is compute-bound
(about 4 x 32 heads x 128 x 32k^2 / 2 x 32 layers = 2.8e14 FLOPs for one 32k prompt of the Llama-3-8B
geometry), and it decides the servers' TTFT and how long their 32k waves take.  Per chunk, one layer,
8 KV heads, GQA 4:1, head_dim 128, one request:

* ``int2``: ``kernels/extend`` (the prefix read from an INT2 store, sink 64 + recent 256 hot, the new
  tokens exact), with its dots on bf16 operands (the default) and on fp32 operands (TF32);
* ``int2_sdpa``: the same INT2 prefill through ``kernels/extend/sdpa.py`` (the prefix dequantized in torch,
  then SDPA over bf16 operands, flash on a GPU): what ``OSCAR_SGLANG_EXTEND_KERNEL=sdpa`` serves with;
* ``sglang``: SGLang's own Triton extend (``extend_attention_fwd``), what its BF16 server runs with
  ``--attention-backend triton``, over a BF16 cache of slots (page 1) in random page order; not
  available where SGLang does not import;
* ``sdpa``: torch ``scaled_dot_product_attention`` (flash backend forced, then efficient) over a dense
  BF16 prefix + chunk with the lower-right causal mask, the GQA heads expanded beforehand (untimed);
* a tile sweep of the INT2 kernel on the last chunk (``block_rows`` x ``block_n`` x ``num_warps``).

FLOPs of a chunk of C tokens over a prefix of P: 4 x q_heads x d x C x (P + (C + 1) / 2); TFLOP/s =
FLOPs / time.  The prompt's row sums its chunks (one layer); x layers gives its attention time.
Checked in the same run: INT2 bf16 dots vs INT2 fp32 dots, and SGLang vs SDPA on the same BF16 data
(relative max difference); on CPU (``smoke``) tiny chunks through Triton's interpreter, also against
the fp32 torch references.
"""

from __future__ import annotations

import time
import traceback

import torch

from oscar_sglang.kernels import api, layout, scenario
from oscar_sglang.kernels.compile_check import EXTEND_SWEEP
from oscar_sglang.kernels.extend import reference as extend_ref
from oscar_sglang.kernels.extend import sdpa as extend_sdpa
from oscar_sglang.kernels.extend import triton_kernel as extend_tk
from oscar_sglang.rotation import derotate_output, rotate_queries

LAYERS = 32                      # Llama-3-8B, the servers' model
DEFAULT_TILE = {"block_rows": 64, "block_n": 32, "num_warps": 8, "num_stages": 2}  # extend_attention's defaults
SWEEP = [dict(DEFAULT_TILE, **t) for t in EXTEND_SWEEP]  # the tiles kernels/compile_check.py compiles too
TOL = 3e-2                       # max |a - b| / max |b| between two bf16 computations of the same attention


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def flops(prefix: int, tokens: int, q_heads: int, d: int) -> float:
    return 4.0 * q_heads * d * tokens * (prefix + (tokens + 1) / 2)


def _sglang_extend():
    """SGLang's Triton extend, or the reason it is not there."""
    try:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    except Exception as e:  # noqa: BLE001 - any import failure is a reason, written down
        return None, f"not available: {type(e).__name__}: {str(e)[:200]}"
    return extend_attention_fwd, None


def _sdpa_lower_right(q, k, v, scale):
    """Causal attention aligned to the last key (tokens after a prefix): ``[1, heads, n, d]`` operands."""
    from torch.nn.attention.bias import causal_lower_right

    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=scale)


class _Problem:
    """One request's prompt of ``prompt`` tokens on pages of 16 in random order: its INT2 store (sink/recent
    hot), BF16 K/V of every slot, and the chunks' new tokens."""

    def __init__(self, prompt: int, kv: int, gqa: int, d: int, sink: int, recent: int, device):
        self.kv, self.q_heads, self.d, self.device = kv, kv * gqa, d, device
        self.paged = scenario.paged_layout([prompt], 16, 7, spare_pages=1, device=device)
        n = self.paged.num_slots
        s = layout.empty_store(n, kv, d, None, sink + recent, device)
        s.k_codes.copy_(torch.randint(0, 256, s.k_codes.shape, dtype=torch.uint8, device=device))
        s.v_codes.copy_(torch.randint(0, 256, s.v_codes.shape, dtype=torch.uint8, device=device))
        for scale, zero in ((s.k_scale, s.k_zero), (s.v_scale, s.v_zero)):
            scale.copy_(torch.rand(scale.shape, device=device) * 0.1 + 0.02)
            zero.copy_(torch.randn(zero.shape, device=device) * 0.1 - 0.15)
        s.k_hot.copy_(torch.randn(s.k_hot.shape, device=device))
        s.v_hot.copy_(torch.randn(s.v_hot.shape, device=device))
        scenario.assign_hot(s, self.paged, sink, recent)
        self.store = s
        self.rot = scenario.random_rotation(kv, d, 0, device=device)
        self.kb = torch.randn(n, kv, d, device=device, dtype=torch.bfloat16)
        self.vb = torch.randn(n, kv, d, device=device, dtype=torch.bfloat16)
        self.row = self.paged.req_to_token[self.paged.req_pool_indices[0]]  # token -> slot

    def chunk(self, prefix: int, tokens: int) -> dict:
        dev, g = self.device, torch.Generator(device=self.device).manual_seed(prefix)
        q = torch.randn(tokens, self.q_heads, self.d, device=dev, generator=g).to(torch.bfloat16)
        new = self.row[prefix: prefix + tokens].long()
        return {"q": q, "k": self.kb[new], "v": self.vb[new], "prefix": prefix, "tokens": tokens,
                "prefix_lens": torch.tensor([prefix], device=dev), "extend_lens": torch.tensor([tokens], device=dev)}

    def int2(self, c: dict, dots: str, **tile):
        return extend_tk.extend_attention(
            c["q"], c["k"], c["v"], self.store, self.rot, self.paged.req_to_token, self.paged.req_pool_indices,
            c["prefix_lens"], c["extend_lens"], self.d**-0.5, max_extend_len=c["tokens"],
            max_prefix_len=c["prefix"], dots=dots, **tile)

    def int2_sdpa(self, c: dict):
        return extend_sdpa.extend_attention(c["q"], c["k"], c["v"], self.store, self.rot, self.paged.req_to_token,
                                            self.paged.req_pool_indices, c["prefix_lens"], c["extend_lens"],
                                            self.d**-0.5)

    def int2_reference(self, c: dict):
        return extend_ref.extend_attention(c["q"], c["k"], c["v"], self.store, self.rot, self.paged.req_to_token,
                                           self.paged.req_pool_indices, c["prefix_lens"], c["extend_lens"],
                                           self.d**-0.5)

    def sglang_runner(self, fwd, c: dict):
        dev, p, n = self.device, c["prefix"], c["tokens"]
        out = torch.empty_like(c["q"])
        qo_indptr = torch.tensor([0, n], dtype=torch.int32, device=dev)
        kv_indptr = torch.tensor([0, p], dtype=torch.int32, device=dev)
        kv_indices = self.row[:p].long()

        def run():
            fwd(c["q"], c["k"], c["v"], out, self.kb, self.vb, qo_indptr, kv_indptr, kv_indices, None, True, None,
                n, 1.0, 1.0, sm_scale=self.d**-0.5, page_size=1, extend_seq_lens_cpu=[n])
            return out
        return run

    def dense(self, c: dict):
        """``[1, q_heads, n, d]`` query and the prefix + chunk keys/values, GQA heads expanded."""
        slots = self.row[: c["prefix"] + c["tokens"]].long()
        gqa = self.q_heads // self.kv

        def heads(x):
            return x[slots].repeat_interleave(gqa, 1).transpose(0, 1).unsqueeze(0).contiguous()
        return c["q"].transpose(0, 1).unsqueeze(0).contiguous(), heads(self.kb), heads(self.vb)


def measure(device, timed, smoke: bool, budget_s: float = 20.0, prompt: int = 32768, chunk: int = 8192,
            kv: int = 8, gqa: int = 4, d: int = 128) -> dict:
    """Rows per chunk, the prompt's sum, the tile sweep, checks and problems (``{"rows", "sweep", ...}``)."""
    t_start = time.time()
    sink, recent = (8, 16) if smoke else (64, 256)
    if smoke:
        prompt, chunk, kv = 96, 32, 2
    pb = _Problem(prompt, kv, gqa, d, sink, recent, device)
    fwd, sglang_note = _sglang_extend()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa_backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION] if device.type == "cuda" \
        else [SDPBackend.MATH]
    result = {"prompt": prompt, "chunk": chunk, "kv_heads": kv, "q_heads": kv * gqa, "d": d, "sink": sink,
              "recent": recent, "layers": LAYERS, "tile": DEFAULT_TILE, "sglang_note": sglang_note,
              "rows": [], "sweep": [], "problems": []}
    problems = result["problems"]
    for prefix in range(0, prompt, chunk):
        c = pb.chunk(prefix, min(chunk, prompt - prefix))
        r = {"prefix": prefix, "tokens": c["tokens"], "GFLOP": flops(prefix, c["tokens"], kv * gqa, d) / 1e9}
        try:
            out = {}
            for dots in extend_tk.DOT_CHOICES:
                out[dots] = pb.int2(c, dots)
                r[f"int2_{dots}_ms"] = timed(lambda dots=dots: pb.int2(c, dots))
            r["int2_bf16_vs_fp32"] = rel_err(out["bf16"], out["tf32"])
            if r["int2_bf16_vs_fp32"] > TOL:
                problems.append(f"prefix {prefix}: INT2 bf16 vs fp32 dots differ by {r['int2_bf16_vs_fp32']:.2e}")
            try:  # the SDPA path failing (e.g. no flash kernel for these shapes) is a finding for its row only
                r["int2_sdpa_vs_fp32"] = rel_err(pb.int2_sdpa(c), out["tf32"])
                r["int2_sdpa_ms"] = timed(lambda: pb.int2_sdpa(c))
                if r["int2_sdpa_vs_fp32"] > TOL:
                    problems.append(f"prefix {prefix}: INT2 via SDPA vs fp32 dots {r['int2_sdpa_vs_fp32']:.2e}")
            except Exception as e:  # noqa: BLE001
                r["int2_sdpa_note"] = f"INT2 via SDPA failed: {type(e).__name__}: {str(e)[:200]}"
                problems.append(f"prefix {prefix}: {r['int2_sdpa_note']}")
                print(traceback.format_exc(), flush=True)
            if smoke:
                r["smoke_int2_vs_reference"] = rel_err(out["bf16"], pb.int2_reference(c))
                if r["smoke_int2_vs_reference"] > TOL:
                    problems.append(f"prefix {prefix}: INT2 vs reference {r['smoke_int2_vs_reference']:.2e}")
            qd, kd, vd = pb.dense(c)
            for backend in sdpa_backends:
                try:
                    with sdpa_kernel(backend):
                        o_sdpa = _sdpa_lower_right(qd, kd, vd, d**-0.5)
                        r["sdpa_ms"] = timed(lambda: _sdpa_lower_right(qd, kd, vd, d**-0.5))
                    r["sdpa_backend"] = backend.name.lower()
                    break
                except RuntimeError as e:  # this backend refused the shapes: the next one
                    r["sdpa_note"] = f"{backend.name}: {str(e)[:160]}"
            if smoke:
                exact = _sdpa_lower_right(qd.float(), kd.float(), vd.float(), d**-0.5)
                r["smoke_sdpa_vs_fp32"] = rel_err(o_sdpa, exact)
            if fwd is not None:
                try:
                    run = pb.sglang_runner(fwd, c)
                    o_sgl = run().transpose(0, 1).unsqueeze(0)
                    r["sglang_ms"] = timed(run)
                except Exception as e:  # noqa: BLE001 - SGLang's kernel failing here is a finding, not a crash
                    fwd, result["sglang_note"] = None, f"failed: {type(e).__name__}: {str(e)[:200]}"
                    problems.append(f"SGLang's extend {result['sglang_note']}")
                    print(traceback.format_exc(), flush=True)
                if fwd is not None and r.get("sdpa_ms") is not None:
                    r["sglang_vs_sdpa"] = rel_err(o_sgl, o_sdpa)
                    if r["sglang_vs_sdpa"] > TOL:
                        problems.append(f"prefix {prefix}: SGLang extend vs SDPA differ by {r['sglang_vs_sdpa']:.2e}")
            del qd, kd, vd
        except Exception as e:  # noqa: BLE001 - one failing chunk is written down, the others still run
            r["note"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            problems.append(f"prefix {prefix}: {r['note']}")
            print(traceback.format_exc(), flush=True)
        _rates(r)
        result["rows"].append(r)
        print(f"extend prefix {prefix} +{c['tokens']}: " + ", ".join(
            f"{k[:-3]} {r[k]:.3f} ms" for k in r if k.endswith("_ms") and r[k] is not None), flush=True)
        last = c
    result["prompt_row"] = _rates(_prompt_sum(result["rows"]))
    try:  # a diagnosis of the sdpa path, not a table of its own: a failure here is a note
        result["sdpa_parts"] = sdpa_parts(pb, last, timed)
    except Exception as e:  # noqa: BLE001
        result["sdpa_parts"] = {"note": f"failed: {type(e).__name__}: {str(e)[:200]}"}
    for tile in [] if smoke else SWEEP:  # the last chunk (the longest prefix), bf16 dots
        if time.time() - t_start > budget_s:
            result["sweep"].append({**tile, "note": f"section budget {budget_s:g} s spent"})
            continue
        try:
            pb.int2(last, "bf16", **tile)
            result["sweep"].append({**tile, "int2_bf16_ms": timed(lambda tile=tile: pb.int2(last, "bf16", **tile))})
        except Exception as e:  # noqa: BLE001 - e.g. a tile over the shared-memory limit
            result["sweep"].append({**tile, "note": f"failed: {type(e).__name__}: {str(e)[:160]}"})
    result["seconds"] = round(time.time() - t_start, 1)
    return result


def _broadcast_rotation(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``rotation._grouped`` as it was until 2026-12-05: ``torch.matmul`` over ``[tokens, kv, group, d]`` and
    ``R [kv, d, d]``, whose broadcast copies ``R`` for every token (timed beside today's, never served)."""
    n, hq, d = x.shape
    kv = r.shape[0]
    return torch.matmul(x.float().reshape(n, kv, hq // kv, d), r).reshape(n, hq, d)


def sdpa_parts(pb: _Problem, c: dict, timed) -> dict:
    """What the sdpa path spends on chunk ``c`` besides its SDPA call: the query rotation and output
    de-rotation (as served, and as the broadcast matmul of run 1), and the prefix's read (``kernels/read``)."""
    q, rot = c["q"], pb.rot
    slots = pb.row[: c["prefix"]]
    backend = extend_sdpa.read_backend(pb.store, q.device.type)
    v_rot_t = rot.v_rot.transpose(-1, -2)
    return {"prefix": c["prefix"], "tokens": c["tokens"], "read_backend": backend,
            "rotations_ms": timed(lambda: derotate_output(rotate_queries(q, rot.q_rot), rot.v_rot)),
            "broadcast_rotations_ms": timed(lambda: _broadcast_rotation(_broadcast_rotation(q, rot.q_rot), v_rot_t)),
            "read_ms": timed(lambda: api.read_rows(pb.store, slots, torch.bfloat16, backend=backend))}


KERNELS = ("int2_bf16", "int2_tf32", "int2_sdpa", "sglang", "sdpa")
LABEL = {"int2_bf16": "INT2, bf16 dots", "int2_tf32": "INT2, TF32 dots", "int2_sdpa": "INT2 via SDPA",
         "sglang": "SGLang Triton BF16", "sdpa": "SDPA BF16"}


def _rates(r: dict) -> dict:
    for k in KERNELS:
        t = r.get(f"{k}_ms")
        r[f"{k}_tflops"] = None if t is None else r["GFLOP"] / t  # GFLOP / ms = TFLOP/s
    bf16 = [r[f"{k}_ms"] for k in ("sglang", "sdpa") if r.get(f"{k}_ms") is not None]
    r["int2_vs_best_bf16"] = r["int2_bf16_ms"] / min(bf16) if bf16 and r.get("int2_bf16_ms") else None
    return r


def _prompt_sum(rows: list[dict]) -> dict:
    out = {"prefix": "all", "tokens": sum(r["tokens"] for r in rows), "GFLOP": sum(r["GFLOP"] for r in rows)}
    for k in KERNELS:
        ts = [r.get(f"{k}_ms") for r in rows]
        out[f"{k}_ms"] = sum(ts) if ts and all(t is not None for t in ts) else None
    return out


def markdown(res: dict | None) -> list[str]:
    """The section of bench_kernels.md."""
    if not res:
        return []

    def ms(x):
        return "n/a" if x is None else f"{x:.3f}"

    def tf(x):
        return "n/a" if x is None else f"{x:.3g}"

    tile = ", ".join(f"{k} {v}" for k, v in res["tile"].items())
    lines = ["", "## Prefill attention per layer: a long prompt in SGLang's chunks", "",
             f"One request's {res['prompt']}-token prompt in chunks of {res['chunk']} (SGLang's chunked prefill; "
             f"8192 is its default on an H200), {res['q_heads']} query / {res['kv_heads']} KV heads, d {res['d']}; "
             f"each chunk attends to its cached prefix and causally to itself (scripts/bench_extend.py). INT2 = "
             f"`kernels/extend` over an INT2 store (sink {res['sink']} + recent {res['recent']} hot), tile {tile}; "
             "INT2 via SDPA = the same store through `kernels/extend/sdpa.py` (prefix dequantized, then SDPA: "
             "`OSCAR_SGLANG_EXTEND_KERNEL=sdpa`); "
             "SGLang Triton BF16 = SGLang's own extend kernel (what its BF16 server runs) over a paged BF16 "
             "cache; SDPA = torch scaled_dot_product_attention over a dense BF16 prefix + chunk, lower-right "
             "causal. TFLOP/s = 4 x q_heads x d x C x (P + (C+1)/2) / time. INT2 / best BF16 > 1: INT2 slower.",
             ""]
    if res.get("sglang_note"):
        lines += [f"SGLang Triton BF16: {res['sglang_note']}", ""]
    lines += ["| prefix | tokens | GFLOP | " + " | ".join(f"{LABEL[k]} ms" for k in KERNELS) + " | "
              + " | ".join(f"{LABEL[k]} TFLOP/s" for k in KERNELS) + " | INT2 / best BF16 |",
              "|" + "---|" * (4 + 2 * len(KERNELS))]
    for r in res["rows"] + [res["prompt_row"]]:
        ratio = r.get("int2_vs_best_bf16")
        lines.append(f"| {r['prefix']} | {r['tokens']} | {r['GFLOP']:.4g} | "
                     + " | ".join(ms(r.get(f"{k}_ms")) for k in KERNELS) + " | "
                     + " | ".join(tf(r.get(f"{k}_tflops")) for k in KERNELS) + f" | {tf(ratio)} |")
    p = res["prompt_row"]
    est = [f"{LABEL[k]} {p[f'{k}_ms'] * res['layers'] / 1e3:.2f} s" for k in KERNELS if p.get(f"{k}_ms")]
    if est:
        lines += ["", f"Attention of the whole prompt over {res['layers']} layers (the row `all` x layers): "
                  + ", ".join(est) + "."]
    checks = [f"prefix {r['prefix']}: " + ", ".join(f"{k} {r[k]:.1e}" for k in r
                                                  if k.endswith(("_vs_fp32", "_vs_sdpa", "_vs_reference")))
              for r in res["rows"]]
    lines += ["", "Agreement (max |a - b| / max |b|): " + "; ".join(checks) + "."]
    parts = res.get("sdpa_parts") or {}
    if parts.get("note"):
        lines += ["", f"Parts of the sdpa path: {parts['note']}"]
    elif parts:
        whole = res["rows"][-1].get("int2_sdpa_ms")
        lines += ["", f"Parts of the sdpa path on the last chunk ({parts['tokens']} tokens over {parts['prefix']} "
                  f"cached), besides its SDPA call: the query rotation and output de-rotation "
                  f"{ms(parts['rotations_ms'])} ms (as `torch.matmul`'s broadcast did them until 2026-12-05: "
                  f"{ms(parts['broadcast_rotations_ms'])} ms); the prefix's read (`kernels/read`, "
                  f"{parts['read_backend']}) {ms(parts['read_ms'])} ms; the whole path {ms(whole)} ms."]
    notes = [f"- prefix {r['prefix']}: {r[k]}" for r in res["rows"] for k in ("note", "sdpa_note", "int2_sdpa_note")
             if r.get(k)]
    if notes:
        lines += [""] + notes
    if res["sweep"]:
        lines += ["", f"Tile sweep of the INT2 kernel (bf16 dots) on the last chunk (default {tile}: "
                  f"{ms(res['rows'][-1].get('int2_bf16_ms'))} ms):", "",
                  "| block_rows | block_n | num_warps | num_stages | ms |", "|---|---|---|---|---|"]
        for s in res["sweep"]:
            lines.append(f"| {s['block_rows']} | {s['block_n']} | {s['num_warps']} | {s['num_stages']} | "
                         f"{ms(s.get('int2_bf16_ms')) if 'note' not in s else s['note']} |")
    return lines
