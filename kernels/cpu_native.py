"""Native float32 CPU kernels (`csrc/cpu_kernels.c`), compiled on first use and called via ctypes.

On a CPU the executor's step is, besides its matmuls, hundreds of small PyTorch operator
calls per step (each RMSNorm, rotation, cache write and attention bucket is several), and
the batched attention gathers every request's context into new tensors each layer before
reading it. These kernels do each of those in one call that reads its operands once and
attends straight from the paged cache through the block table; `linear` is the float32
matmul against weights packed once by `pack_panels` (services/executor/packed_weights.py;
bfloat16 weights and the int8 codes of ``--quantization int8`` into panels of their own, the
activations float32).

The source is compiled with the system C compiler (``$CC``, else ``cc``) with `FLAGS` into
``$WEIR_CACHE/kernels/`` (a file per source, compiler and CPU), once per machine; the
library links the libgomp PyTorch already loaded, so the kernels run on PyTorch's OpenMP
threads. Where no compiler works, or with ``WEIR_NATIVE_CPU_KERNELS=0``, `load` returns
None and the executor keeps the PyTorch operator path (`cpu_attention`), which computes
the same thing.
"""

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from weir.kernels.reference import AttentionSpan, check_sinks, to_cache
from weir.shared.model_store import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
# -falign-loops=64: the panel matmul's inner loop is 128 bytes; started mid-line it spans three
# 64-byte fetch lines instead of two and ran 4-6% slower (docs/benchmarks.md).
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=fast",
    "-falign-loops=64",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c11",
)

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_SIGNATURES = {
    "weir_rms_norm": (None, [_P, _I, _P, _P, _I, _I, _I, _F]),
    "weir_rope": (None, [_P, _I, _I, _I, _I, _I, _P, _P]),
    "weir_write_kv": (ctypes.c_int, [_P, _I, _P, _I, _P, _I, _P, _P, _I, _I, _I]),
    "weir_paged_attention": (
        ctypes.c_int,
        [_P, _I, _P, _I, _I, _P, _P, _I, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I]
        # scale, span, chunked, softcap, sinks, fp8 format and values
        + [_F, _I, _I, _F, _P, _I, _P],
    ),
    "weir_silu_mul": (None, [_P, _I, _I, _I]),
    "weir_causal_conv1d": (ctypes.c_int, [_P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _P]),
    "weir_gated_delta_decode": (
        ctypes.c_int,
        [_P, _I, _P, _I, _P, _I, _P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _P],
    ),
    "weir_pack_panels": (None, [_P, _I, _I, _P]),
    "weir_linear": (None, [_P, _I, _I, _P, _I, _I, _P, _P, _I, _P, _I]),
    "weir_linear_silu_mul": (None, [_P, _I, _I, _P, _I, _I, _P, _P, _I]),
    "weir_pack_panels_bf16": (None, [_P, _I, _I, _P]),
    "weir_linear_bf16": (ctypes.c_int, [_P, _I, _I, _P, _I, _I, _P, _P, _I, _P, _I]),
    "weir_linear_silu_mul_bf16": (ctypes.c_int, [_P, _I, _I, _P, _I, _I, _P, _P, _I]),
    "weir_bf16_matmul_unit": (ctypes.c_int, []),
    "weir_pack_panels_int8": (None, [_P, _I, _I, _P]),
    "weir_linear_int8": (ctypes.c_int, [_P, _I, _I, _P, _I, _I, _P, _P, _P, _I, _P, _I]),
    "weir_linear_silu_mul_int8": (ctypes.c_int, [_P, _I, _I, _P, _I, _I, _P, _P, _P, _I]),
}
# What weir_bf16_matmul_unit's answers name.
BF16_MATMUL_UNITS = ("float32 FMAs", "AVX512_BF16", "AMX tiles")
PANEL = 16  # weight rows per panel of `pack_panels` (PANEL in the C source)


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))


def _compile(compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    key = hashlib.sha256(
        "\0".join((SOURCE.read_text(), compiler, version, " ".join(flags), _cpu_id())).encode()
    ).hexdigest()[:16]
    target = cache_root() / "kernels" / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, "-o", str(built), str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        os.replace(built, target)  # atomic: concurrent executors never load a partial file
    log.info("compiled native CPU kernels into %s", target)
    return target


@functools.cache
def load() -> "CpuKernels | None":
    """The compiled kernels, or None (disabled, or no working C compiler: see the module doc)."""
    if os.environ.get("WEIR_NATIVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        log.warning("no C compiler (%s) found: CPU steps use the slower PyTorch kernels", compiler)
        return None
    try:
        lib = ctypes.CDLL(str(_compile(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("native CPU kernels unavailable (%s): using the PyTorch kernels", detail)
        return None
    return CpuKernels(lib)


def load_with(extra_flags: tuple[str, ...]) -> "CpuKernels":
    """The kernels compiled with more flags, uncached by `load`: tests build the 256-bit
    matmul on a machine with AVX-512 (``-mno-avx512f``). Raises where they do not build."""
    return CpuKernels(ctypes.CDLL(str(_compile(os.environ.get("CC") or "cc", FLAGS + extra_flags))))


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def is_bf16_panels(panels: torch.Tensor) -> bool:
    """Whether `pack_panels` packed a bfloat16 weight (int32 words of bf16 pairs)."""
    return panels.dtype == torch.int32


# The caches the attention kernel widens as it reads them, by its format number (0: a float32
# cache, read as it is).
FP8_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
CACHE_FORMATS = {**FP8_FORMATS, torch.bfloat16: 3}


@functools.cache
def fp8_values(dtype: torch.dtype) -> torch.Tensor:
    """The float32 value of each of the 256 bytes of an fp8 ``dtype``, as PyTorch reads them."""
    if dtype not in FP8_FORMATS:
        raise ValueError(f"the native kernels read float32 or fp8 caches, not {dtype}")
    return torch.arange(256, dtype=torch.uint8).view(dtype).float()


class CpuKernels:
    """Typed wrappers. Tensors are float32 on the CPU; the last dimension of every activation
    is contiguous and rows may be strided (views into a fused projection's output)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self._lib = lib

    @property
    def bf16_matmul_unit(self) -> str:
        """What the bfloat16 panels' matmul multiplies with on this CPU (one of
        BF16_MATMUL_UNITS; AMX's tiles from a few rows up)."""
        return BF16_MATMUL_UNITS[self._lib.weir_bf16_matmul_unit()]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x [T, dim] into a new [T, dim] tensor."""
        out = torch.empty(x.shape, dtype=torch.float32)
        self._lib.weir_rms_norm(
            _ptr(x),
            x.stride(0),
            _ptr(weight),
            _ptr(out),
            out.stride(0),
            x.shape[0],
            x.shape[1],
            eps,
        )
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate-half RoPE in place: x [T, heads, D] (each head's D channels contiguous, as
        in a view of a head's first D); cos, sin [T, D/2] contiguous."""
        self._lib.weir_rope(
            _ptr(x),
            x.stride(0),
            x.stride(1),
            x.shape[0],
            x.shape[1],
            x.shape[2],
            _ptr(cos),
            _ptr(sin),
        )

    def silu_mul_(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up written over gate, for gate_up [T, 2 * I] (rows may be strided):
        returns that [T, I] view."""
        dim = gate_up.shape[1] // 2
        self._lib.weir_silu_mul(_ptr(gate_up), gate_up.stride(0), gate_up.shape[0], dim)
        return gate_up[:, :dim]

    def causal_conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        query_start: torch.Tensor,
        slots: torch.Tensor,
        fresh: torch.Tensor,
    ) -> torch.Tensor:
        """`weir.kernels.gated_delta_net.causal_conv1d` of a float32 batch, without gathering
        the states: x [T, C] (rows may be strided), weight [C, K], bias [C] or None,
        conv_state [S, C, K - 1] contiguous, updated in place; query_start [R + 1], slots and
        fresh (1: the request's state is zero, whatever its slot holds) [R], int64, slots
        distinct. Returns [T, C]. Rows or slots out of range raise IndexError, nothing
        written."""
        num_tokens, channels = x.shape
        taps = weight.shape[1]
        if not (
            all(t.dtype == torch.float32 for t in (x, weight, conv_state))
            and (bias is None or (bias.dtype == torch.float32 and bias.shape == (channels,)))
            and all(
                t.dtype == torch.int64 and t.is_contiguous() for t in (query_start, slots, fresh)
            )
            and len(query_start) == len(slots) + 1 == len(fresh) + 1
            and weight.shape[0] == channels
            and conv_state.shape[1:] == (channels, taps - 1)
            and conv_state.is_contiguous()
        ):
            raise ValueError(
                f"causal_conv1d: x {tuple(x.shape)}, weight {tuple(weight.shape)}, conv_state "
                f"{tuple(conv_state.shape)}: want float32, a contiguous state, int64 "
                "query_start/slots/fresh"
            )
        if x.stride(1) != 1:
            x = x.contiguous()
        weight = weight.contiguous()
        bias = None if bias is None else bias.contiguous()
        out = torch.empty(num_tokens, channels, dtype=torch.float32)
        status = self._lib.weir_causal_conv1d(
            _ptr(x),
            x.stride(0),
            _ptr(weight),
            None if bias is None else _ptr(bias),
            _ptr(conv_state),
            conv_state.shape[0],
            _ptr(query_start),
            _ptr(slots),
            _ptr(fresh),
            len(slots),
            num_tokens,
            channels,
            taps,
            _ptr(out),
        )
        if status == -2:
            raise IndexError("a request's rows or conv state slot lie outside the batch or states")
        if status != 0:
            raise MemoryError("native causal_conv1d could not allocate its transposed weight")
        return out

    def gated_delta_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
        fresh: torch.Tensor,
    ) -> torch.Tensor:
        """One step of the gated delta rule for D single-token requests, in place in their
        slots of state [S, Hv, Dk, Dv] (contiguous): request r's token is row rows[r] of q, k
        [T, Hk, Dk] (L2-normalized, q scaled by Dk ** -0.5), v [T, Hv, Dv] and g, beta [T,
        Hv]; its state slot slots[r], zero (whatever it holds) where fresh[r] is 1 (int64 [D]
        each; slots distinct). All float32; q, k, v's rows may be strided (copied where a
        row's heads are not contiguous). Returns o [D, Hv, Dv] float32:
        `weir.kernels.gated_delta_net._recurrent_step`'s, without gathering the states. A row
        or slot out of range raises IndexError, nothing written."""
        num_tokens, k_heads, k_dim = k.shape
        v_heads, v_dim = v.shape[1:]
        if not (
            all(t.dtype == torch.float32 for t in (q, k, v, g, beta, state))
            and all(t.dtype == torch.int64 and t.is_contiguous() for t in (rows, slots, fresh))
            and rows.shape == slots.shape == fresh.shape
            and q.shape == k.shape
            and g.shape == beta.shape == (num_tokens, v_heads)
            and state.shape[1:] == (v_heads, k_dim, v_dim)
            and state.is_contiguous()
            and v_heads % k_heads == 0
        ):
            raise ValueError(
                f"gated_delta_decode: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                f"{tuple(v.shape)}, g/beta {tuple(g.shape)}, state {tuple(state.shape)}: want "
                "float32, a contiguous state, Hv a multiple of Hk, int64 rows/slots/fresh"
            )
        q, k, v = (
            t if t.stride(1) == t.shape[2] and t.stride(2) == 1 else t.contiguous()
            for t in (q, k, v)
        )
        g, beta = g.contiguous(), beta.contiguous()
        out = torch.empty(len(rows), v_heads, v_dim, dtype=torch.float32)
        status = self._lib.weir_gated_delta_decode(
            _ptr(q),
            q.stride(0),
            _ptr(k),
            k.stride(0),
            _ptr(v),
            v.stride(0),
            _ptr(g),
            _ptr(beta),
            num_tokens,
            _ptr(rows),
            _ptr(slots),
            _ptr(fresh),
            len(rows),
            _ptr(state),
            state.shape[0],
            k_heads,
            v_heads,
            k_dim,
            v_dim,
            _ptr(out),
        )
        if status != 0:
            raise IndexError("a decode's row or state slot lies outside the batch or states")
        return out

    def reshape_and_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """key, value [T, Hkv, D] (strided rows) into kv_cache [2, blocks, block_size, Hkv, D]
        (float32; bfloat16 or fp8: converted first, fp8 saturating) at int64 slots [T]; slot
        -1 is skipped. A slot outside the cache raises IndexError (nothing is written), as
        PyTorch's indexing would: the step fails, the process lives."""
        if kv_cache.dtype != torch.float32:
            key, value = to_cache(key, kv_cache.dtype), to_cache(value, kv_cache.dtype)
        status = self._lib.weir_write_kv(
            _ptr(key),
            key.stride(0),
            _ptr(value),
            value.stride(0),
            _ptr(slots),
            key.shape[0],
            _ptr(kv_cache[0]),
            _ptr(kv_cache[1]),
            key.shape[1] * key.shape[2],
            kv_cache.shape[1] * kv_cache.shape[2],
            kv_cache.element_size(),
        )
        if status != 0:
            raise IndexError("a K/V cache slot of this step lies outside the cache")

    def paged_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        scale: float,
        *,
        span: AttentionSpan | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`weir.kernels.reference.paged_attention`'s contract, its span (sliding window or
        chunk), soft cap and sinks included: query [T, H, D] -> [T, H, D], int32 metadata, a
        float32, bfloat16 or fp8 cache; rows of no request are left unset. Metadata that points outside
        the batch, the block table or the cache raises IndexError before anything is read."""
        num_tokens, num_heads, head_dim = query.shape
        if softcap is not None and softcap <= 0:
            raise ValueError(f"a soft cap of {softcap} is not positive")
        if num_heads % kv_cache.shape[3] or head_dim != kv_cache.shape[4]:
            raise ValueError(
                f"query heads {num_heads} x {head_dim} do not group over the cache's "
                f"{kv_cache.shape[3]} x {kv_cache.shape[4]} KV heads"
            )
        if sinks is not None:
            sinks = check_sinks(sinks, num_heads).float().contiguous()
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
        status = self._lib.weir_paged_attention(
            _ptr(query),
            query.stride(0),
            _ptr(out),
            out.stride(0),
            num_tokens,
            _ptr(kv_cache[0]),
            _ptr(kv_cache[1]),
            kv_cache.shape[1],
            _ptr(query_start_loc),
            _ptr(seq_lens),
            seq_lens.shape[0],
            _ptr(block_table),
            block_table.stride(0),
            block_table.shape[1],
            kv_cache.shape[2],
            num_heads,
            kv_cache.shape[3],
            head_dim,
            scale,
            0 if span is None else span.size,  # 0: no span
            span is not None and span.chunked,
            0.0 if softcap is None else softcap,  # 0: no cap
            None if sinks is None else _ptr(sinks),
            CACHE_FORMATS.get(kv_cache.dtype, 0),
            _ptr(fp8_values(kv_cache.dtype)) if kv_cache.dtype in FP8_FORMATS else None,
        )
        if status == -2:
            raise IndexError("attention metadata of this step points outside the batch or cache")
        if status != 0:
            raise MemoryError("native paged attention could not allocate its scratch memory")
        return out

    def pack_panels(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] -> the panel layout `linear` reads: float32 weights into float32
        panels [ceil(N / 16), K, 16], int8 codes into int8 panels alike; bfloat16 ones into
        panels of bf16 pairs, int32 words [ceil(N / 16), ceil(K / 2), 16] (each word two
        consecutive inputs' bf16 bits, the even input's in the low half)."""
        weight = weight.detach().contiguous()
        n, k = weight.shape
        if weight.dtype == torch.int8:
            panels = torch.empty(-(-n // PANEL), k, PANEL, dtype=torch.int8)
            self._lib.weir_pack_panels_int8(_ptr(weight), n, k, _ptr(panels))
            return panels
        if weight.dtype == torch.bfloat16:
            panels = torch.empty(-(-n // PANEL), -(-k // 2), PANEL, dtype=torch.int32)
            self._lib.weir_pack_panels_bf16(_ptr(weight), n, k, _ptr(panels))
            return panels
        panels = torch.empty(-(-n // PANEL), k, PANEL, dtype=torch.float32)
        self._lib.weir_pack_panels(_ptr(weight), n, k, _ptr(panels))
        return panels

    def linear(
        self,
        x: torch.Tensor,
        panels: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(residual +) x @ weight.T (+ bias) with the weight as `pack_panels` gave it: x [M, K]
        float32 with contiguous rows, bias [N], residual [M, N] (rows may be strided). Over
        bf16 panels x is rounded to bf16 and the sums are float32; int8 panels hold codes, the
        weight being codes[j] * scale[j] (scale float32 [N], applied to the sums)."""
        return self._panel_matmul(
            "weir_linear",
            x,
            panels,
            out_features,
            out_features,
            scale,
            bias,
            None if residual is None else _ptr(residual),
            0 if residual is None else residual.stride(0),
        )

    def linear_silu_mul(
        self,
        x: torch.Tensor,
        panels: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """silu(gate) * up of a gated MLP in one pass: the panels hold its fused gate/up weight
        [2 * out_features, K] (gate rows first; out_features a multiple of 16), bias and int8
        panels' scale [2 * out_features]; x [M, K] -> [M, out_features], never writing the
        [M, 2 * out_features] projection. The same arithmetic as `linear` then `silu_mul_`."""
        if out_features % PANEL or panels.shape[0] * PANEL != 2 * out_features:
            raise ValueError(
                f"linear_silu_mul: {out_features} outputs need {2 * out_features // PANEL} "
                f"panels of {PANEL} weight rows, got {panels.shape[0]}"
            )
        return self._panel_matmul(
            "weir_linear_silu_mul", x, panels, out_features, 2 * out_features, scale, bias
        )

    def _panel_matmul(
        self,
        name: str,
        x: torch.Tensor,
        panels: torch.Tensor,
        out_features: int,
        weight_rows: int,
        scale: torch.Tensor | None,
        bias: torch.Tensor | None,
        *epilogue: int | None,
    ) -> torch.Tensor:
        """Call the panel matmul ``name`` for the panels' dtype (float32's; ``_bf16``'s; the
        ``_int8``'s, which takes the weight_rows scales after K): (x, x stride, rows, panels,
        N, K, bias, *epilogue, out, out stride), into a new [M, out_features] tensor."""
        k, steps = x.shape[-1], panels.shape[1]
        bf16, int8 = is_bf16_panels(panels), panels.dtype == torch.int8
        if x.dim() != 2 or (-(-k // 2) if bf16 else k) != steps or x.stride(1) != 1:
            inputs = f"{steps} input pairs" if bf16 else f"{steps} inputs"
            raise ValueError(f"linear: x {tuple(x.shape)} does not fit a weight of {inputs}")
        scales: tuple[int, ...] = ()
        if int8:
            if scale is None or scale.dtype != torch.float32 or not scale.is_contiguous():
                raise ValueError("linear: int8 panels need their float32 scales, contiguous")
            if scale.numel() != weight_rows:
                raise ValueError(f"linear: {scale.numel()} scales for {weight_rows} weight rows")
            scales = (_ptr(scale),)
        fn = getattr(self._lib, name + ("_bf16" if bf16 else "_int8" if int8 else ""))
        out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
        failed = fn(
            _ptr(x),
            x.stride(0),
            x.shape[0],
            _ptr(panels),
            out_features,
            k,
            *scales,
            None if bias is None else _ptr(bias),
            *epilogue,
            _ptr(out),
            out.stride(0),
        )
        if failed:
            raise MemoryError(f"linear: no memory for {x.shape[0]} rows' bfloat16 copy")
        return out
