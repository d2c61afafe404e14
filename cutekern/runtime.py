"""DSL-free runtime: load exported kernels and launch them on torch tensors.

Works where nvidia-cutlass-dsl is NOT installed (a serving box, the lent GPU machine):
it needs only torch, a manifest written by ``cutekern export`` and the DSL's small C
runtime (``libcute_dsl_runtime.so``), loaded with ctypes. Each call's arguments are
checked against the manifest ABI (dtype, rank, device, contiguity, alignment, extents)
before anything is launched; errors name the argument.
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import lzma
import os
import shutil
import struct
import threading
from pathlib import Path

from .abi import DTYPE_BYTES

ENV_LIB = "CUTEKERN_RUNTIME_LIB"
_INT32_MAX = 2**31 - 1


class CuteKernRuntimeError(RuntimeError):
    pass


# ---------------------------------------------------------------- the C library
def _find_library(bundle_dir: Path | None) -> Path:
    env = os.environ.get(ENV_LIB)
    if env:
        return Path(env)
    if bundle_dir is not None:
        plain = bundle_dir / "lib" / "libcute_dsl_runtime.so"
        packed = bundle_dir / "lib" / "libcute_dsl_runtime.so.xz"
        if plain.exists():
            return plain
        if packed.exists():
            # unpack once, next to a per-user cache, atomically
            dst_dir = Path(os.environ.get("CUTEKERN_CACHE_DIR", Path.home() / ".cache" / "cutekern")) / "lib"
            dst_dir.mkdir(parents=True, exist_ok=True)
            dst = dst_dir / f"libcute_dsl_runtime-{packed.stat().st_size}.so"
            if not dst.exists():
                tmp = dst.with_suffix(f".tmp{os.getpid()}")
                with lzma.open(packed) as src, open(tmp, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                os.replace(tmp, dst)
            return dst
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")  # finds, does not import the DSL
    if spec is not None:
        base = Path(list(spec.submodule_search_locations)[0])
        libs = sorted(base.glob("cu*/lib/libcute_dsl_runtime.so"))
        if libs:
            return libs[-1]
    raise CuteKernRuntimeError(
        "libcute_dsl_runtime.so not found: set CUTEKERN_RUNTIME_LIB, ship it in the "
        "bundle's lib/ folder, or install nvidia-cutlass-dsl")


class _Lib:
    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        lib.CuteDSLRT_Module_Create_From_Bytes.argtypes = [
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t,
            ctypes.c_void_p, ctypes.c_size_t]
        lib.CuteDSLRT_Module_Get_Function.argtypes = [
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        lib.CuteDSLRT_Function_Run.argtypes = [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.CuteDSLRT_GetErrorString.restype = ctypes.c_char_p
        lib.CuteDSLRT_GetErrorString.argtypes = [ctypes.c_int]
        for fn in ("CuteDSLRT_Module_Create_From_Bytes", "CuteDSLRT_Module_Get_Function",
                   "CuteDSLRT_Function_Run"):
            getattr(lib, fn).restype = ctypes.c_int
        self.lib = lib

    def check(self, err: int, what: str):
        if err != 0:
            msg = self.lib.CuteDSLRT_GetErrorString(err)
            raise CuteKernRuntimeError(f"{what}: runtime error {err} "
                                       f"({msg.decode() if msg else '?'})")


_libs: dict = {}
_lock = threading.Lock()


def _library(bundle_dir: Path | None) -> _Lib:
    path = _find_library(bundle_dir)
    with _lock:
        if path not in _libs:
            _libs[path] = _Lib(path)
        return _libs[path]


# ---------------------------------------------------------------- argument structs
_struct_cache: dict = {}


def tensor_struct(rank: int):
    """C struct of a tensor argument whose modes are all dynamic and whose last mode is
    contiguous: {void* data; int32 shapes[rank]; int64 strides[rank-1]} (as the
    exported header declares it)."""
    if rank not in _struct_cache:
        fields = [("data", ctypes.c_void_p), ("dynamic_shapes", ctypes.c_int32 * rank)]
        if rank > 1:
            fields.append(("dynamic_strides", ctypes.c_int64 * (rank - 1)))
        _struct_cache[rank] = type(f"CuteKernTensor{rank}", (ctypes.Structure,), {"_fields_": fields})
    return _struct_cache[rank]


def _validate_tensor(spec: dict, t, where: str, device, require_cuda=True):
    import torch
    name = spec["name"]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    want = getattr(torch, spec["dtype"])  # manifest dtype names are torch attribute names
    if t.dtype != want:
        raise TypeError(f"{where}: argument '{name}' must be {want}, got {t.dtype}")
    if t.dim() != spec["rank"]:
        raise ValueError(f"{where}: argument '{name}' must have rank {spec['rank']}, got shape {tuple(t.shape)}")
    align = spec["align"]
    ebytes = DTYPE_BYTES[spec["dtype"]]
    if t.numel() > 0 and t.data_ptr() % (align * ebytes) != 0:
        raise ValueError(f"{where}: argument '{name}' data pointer must be {align * ebytes}-byte aligned")
    shape, stride = list(t.shape), list(t.stride())
    if any(s > _INT32_MAX for s in shape):
        raise ValueError(f"{where}: argument '{name}' has an extent over 2**31-1: {tuple(shape)}")
    if shape[-1] > 1 and stride[-1] != 1:
        raise ValueError(f"{where}: argument '{name}' must be contiguous in its last dim (stride {stride[-1]})")
    fixed = []
    running = 1  # extent in elements of the modes to the right
    for i in range(len(shape) - 1, -1, -1):
        s = stride[i]
        if i < len(shape) - 1:
            if shape[i] == 1:
                # a size-1 mode never addresses memory; give it a canonical aligned stride
                s = -(-running // align) * align
            if s < 0:
                raise ValueError(f"{where}: argument '{name}' has a negative stride in dim {i}")
            if s % align != 0:
                raise ValueError(f"{where}: argument '{name}' stride {s} of dim {i} must be a "
                                 f"multiple of {align} elements ({align * ebytes} bytes)")
        fixed.append(s)
        running = max(running, s * shape[i])
    fixed.reverse()
    if require_cuda and t.device.type != "cuda":
        raise ValueError(f"{where}: argument '{name}' must be on a CUDA device, got {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{where}: argument '{name}' is on {t.device}, others on {device}")
    return shape, fixed


_INT32_MIN = -2**31


def _validate_scalar(spec: dict, v, where: str):
    name = spec["name"]
    if spec["dtype"] == "int32":
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{where}: argument '{name}' must be a Python int, got {type(v).__name__}")
        if not _INT32_MIN <= v <= _INT32_MAX:
            raise ValueError(f"{where}: argument '{name}' = {v} does not fit in int32")
    else:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise TypeError(f"{where}: argument '{name}' must be a Python float, got {type(v).__name__}")
    return v


_torch_c = None


def _tc():
    """torch._C, imported on first use (exporting needs no torch)."""
    global _torch_c
    if _torch_c is None:
        import torch
        _torch_c = torch._C
    return _torch_c


def _raw_stream(device) -> int:
    """The current CUDA stream handle of ``device`` (torch's raw getter, as torch.compile's
    generated code uses it: ~0.1 us of host time against ~3 us for
    ``torch.cuda.current_stream(device).cuda_stream``)."""
    c = _tc()
    return c._cuda_getCurrentRawStream(device.index if device.index is not None
                                       else c._cuda_getDevice())


def stream_scratch(store: dict, device, numel: int):
    """int32 zeros for a kernel that leaves its scratch words as it found them (zero
    counters, cleared exchange words): one buffer per (device, stream) in ``store``, grown to
    ``numel``, since launches on one stream never overlap; a fresh one while a CUDA graph is
    being captured (the capture then owns it)."""
    import torch
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(numel, dtype=torch.int32, device=device)
    key = (device.index, _raw_stream(device))
    buf = store.get(key)
    if buf is None or buf.numel() < numel:
        buf = store[key] = torch.zeros(numel, dtype=torch.int32, device=device)
    return buf


class _Layout:
    """Where one launch's arguments sit in a flat byte buffer, in ABI order: every slot
    8-byte aligned, tensors as their ctypes struct lays them out, then the int32 return
    slot. One ``struct.pack_into`` call fills a buffer; the pointer array the runtime takes
    is the buffer's address plus the slot offsets."""

    def __init__(self, abi):
        self.offsets = []
        fmt, pos = "<", 0

        def field(code, at, n=1):  # pad up to `at`, then n fields of one struct code
            nonlocal fmt, pos
            fmt += "x" * (at - pos) + code * n
            pos = at + n * struct.calcsize("<" + code)

        for spec in abi:
            base = -(-pos // 8) * 8
            self.offsets.append(base)
            if spec["kind"] == "tensor":
                st, r = tensor_struct(spec["rank"]), spec["rank"]
                field("Q", base + st.data.offset)
                field("i", base + st.dynamic_shapes.offset, r)
                if r > 1:
                    field("q", base + st.dynamic_strides.offset, r - 1)
                field("", base + ctypes.sizeof(st))  # the struct's tail padding
            elif spec["kind"] == "scalar":
                field("i" if spec["dtype"] == "int32" else "f", base)
            else:  # the stream handle
                field("Q", base)
        self.ret_offset = -(-pos // 8) * 8
        field("i", self.ret_offset)
        self.fmt = fmt
        self.size = self.ret_offset + 8

    def buffer(self):
        """A zeroed buffer, its pointer array and the return slot."""
        buf = ctypes.create_string_buffer(self.size)
        base = ctypes.addressof(buf)
        n = len(self.offsets)
        ptrs = (ctypes.c_void_p * (n + 1))(*[base + o for o in self.offsets],
                                           base + self.ret_offset)
        ret = ctypes.c_int32.from_buffer(buf, self.ret_offset)
        return buf, ptrs, ret


class KernelFunction:
    """One exported variant, callable with torch tensors and Python scalars in ABI order
    (every argument but the stream)."""

    def __init__(self, meta: dict, object_path: Path, lib: _Lib):
        self._init_abi(meta)
        self._lib = lib
        data = object_path.read_bytes()
        self._module = ctypes.c_void_p()
        lib.check(lib.lib.CuteDSLRT_Module_Create_From_Bytes(
            ctypes.byref(self._module), data, len(data), None, 0), f"loading {object_path}")
        self._fn = ctypes.c_void_p()
        lib.check(lib.lib.CuteDSLRT_Module_Get_Function(
            ctypes.byref(self._fn), self._module, self.prefix.encode()), f"finding {self.prefix}")
        self._run = lib.lib.CuteDSLRT_Function_Run

    def _init_abi(self, meta: dict):
        """Everything packing needs (no module: the CPU tests pack without a GPU)."""
        self.meta = meta
        self.abi = meta["abi"]
        self.prefix = meta["prefix"]
        self._arg_specs = [s for s in self.abi if s["kind"] != "stream"]
        self._layout = _Layout(self.abi)
        # per ABI slot: index into the call's arguments (-1: the stream), and its rank
        # (0: a scalar)
        self._slots = []
        i = 0
        for spec in self.abi:
            if spec["kind"] == "stream":
                self._slots.append((-1, 0))
                continue
            self._slots.append((i, spec["rank"] if spec["kind"] == "tensor" else 0))
            i += 1
        # eager calls pack into a buffer of their thread's (the runtime copies the
        # arguments at launch, so the next call may overwrite it)
        self._tls = threading.local()

    def _values(self, args, dims, stream: int) -> list:
        vals = []
        for i, rank in self._slots:
            if i < 0:
                vals.append(stream)
            elif rank == 0:
                vals.append(args[i])
            else:
                shape, stride = dims[i]
                vals.append(args[i].data_ptr())
                vals += shape
                if rank > 1:
                    vals += stride[:-1]
        vals.append(0)  # return slot
        return vals

    def _pack_into(self, buf, args, dims, stream: int):
        try:
            struct.pack_into(self._layout.fmt, buf, 0, *self._values(args, dims, stream))
        except struct.error as e:
            where = f"cutekern {self.meta['op']}[{self.meta['design']}/{self.meta['arch']}]"
            for spec, a in zip(self._arg_specs, args):
                if spec["kind"] == "scalar":
                    _validate_scalar(spec, a, where)  # names the argument
            raise CuteKernRuntimeError(f"{self.prefix}: cannot pack the arguments ({e})") from None

    def _go(self, ptrs, ret, device):
        """Run the packed launch on ``device`` (its stream already packed)."""
        if device.index is not None and device.index != _tc()._cuda_getDevice():
            import torch
            with torch.cuda.device(device):
                err = self._run(self._fn, ptrs, len(ptrs))
        else:
            err = self._run(self._fn, ptrs, len(ptrs))
        self._lib.check(err, f"launching {self.prefix}")
        if ret.value != 0:
            raise CuteKernRuntimeError(f"launching {self.prefix}: CUDA error {ret.value}")

    def _dims(self, args, check):
        if check:
            return validate_args(self.meta, args)
        _check_count(self.prefix, self._arg_specs, args)  # a mismatch would mis-pack silently
        dims = [_fast_dims(a, spec) if spec["kind"] == "tensor" else None
                for a, spec in zip(args, self._arg_specs)]
        device = next(a.device for a, spec in zip(args, self._arg_specs) if spec["kind"] == "tensor")
        return dims, device

    def __call__(self, *args, stream=None, check=True):
        """Launch on ``stream`` (default: torch's current stream of the tensors' device).
        ``check=False`` skips the ABI validation for callers that already did it."""
        dims, device = self._dims(args, check)
        tls = self._tls
        if not hasattr(tls, "buf"):
            tls.buf, tls.ptrs, tls.ret = self._layout.buffer()
        self._pack_into(tls.buf, args, dims, _raw_stream(device) if stream is None else stream)
        self._go(tls.ptrs, tls.ret, device)

    def bind(self, *args, check=True) -> "BoundCall":
        """Validate and pack the arguments once; ``BoundCall.launch()`` then only sets the
        stream and calls into the runtime (no allocation, no host sync)."""
        dims, device = self._dims(args, check)
        buf, ptrs, ret = self._layout.buffer()
        self._pack_into(buf, args, dims, 0)
        return BoundCall(self, args, buf, ptrs, ret, device)


class BoundCall:
    """A launch with fixed arguments (the tensors are kept alive here). One launch at a time
    per BoundCall: the stream and return slots are shared between its launches."""

    def __init__(self, fn: KernelFunction, args, buf, ptrs, ret, device):
        self.fn, self.args, self.device = fn, args, device
        self._buf, self._ptrs, self._ret = buf, ptrs, ret
        self._stream = ctypes.c_uint64.from_buffer(buf, fn._layout.offsets[
            next(j for j, (i, _) in enumerate(fn._slots) if i < 0)])

    def launch(self, stream=None):
        self._stream.value = _raw_stream(self.device) if stream is None else stream
        self._ret.value = 0
        self.fn._go(self._ptrs, self._ret, self.device)


def _fast_dims(t, spec):
    """(shape, strides) as the kernel takes them, without checks (size-1 modes get the
    canonical stride validate_args would give them)."""
    shape, stride = list(t.shape), list(t.stride())
    if 1 in shape[:-1]:
        return _validate_tensor(spec, t, "", None, require_cuda=False)
    return shape, stride


def _check_count(where: str, specs, args):
    if len(args) != len(specs):
        raise TypeError(f"{where}: expected {len(specs)} arguments "
                        f"({', '.join(s['name'] for s in specs)}), got {len(args)}")


def validate_args(meta: dict, args, require_cuda: bool = True) -> tuple:
    """Check arguments against a manifest entry's ABI; returns ([(shape, strides) per tensor,
    None per scalar], device)."""
    where = f"cutekern {meta['op']}[{meta['design']}/{meta['arch']}]"
    specs = [s for s in meta["abi"] if s["kind"] != "stream"]
    _check_count(where, specs, args)
    device = None
    out = []
    for spec, a in zip(specs, args):
        if spec["kind"] == "scalar":
            _validate_scalar(spec, a, where)
            out.append(None)
            continue
        out.append(_validate_tensor(spec, a, where, device, require_cuda))
        device = a.device
    return out, device


def _lookup_key(op, design, arch, dtypes, flags) -> tuple:
    return (op, design, arch, tuple(sorted(dict(dtypes).items())), tuple(sorted(dict(flags).items())))


class Manifest:
    """An export directory: manifest.json plus per-arch objects."""

    def __init__(self, root):
        self.root = Path(root)
        path = self.root / "manifest.json"
        if not path.exists():
            raise CuteKernRuntimeError(f"no manifest.json in {self.root} (run `cutekern export`)")
        self.data = json.loads(path.read_text())
        self.entries = {}
        for e in self.data["kernels"]:
            self.entries[_lookup_key(e["op"], e["design"], e["arch"], e["dtypes"], e["flags"])] = e
        self._loaded: dict = {}

    def function(self, op, design, arch, dtypes, flags) -> KernelFunction:
        k = _lookup_key(op, design, arch, dtypes, flags)
        if k not in self._loaded:
            if k not in self.entries:
                raise CuteKernRuntimeError(
                    f"{self.root}: no exported kernel for op={op} design={design} arch={arch} "
                    f"dtypes={dict(dtypes)} flags={dict(flags)}")
            e = self.entries[k]
            self._loaded[k] = KernelFunction(e, self.root / e["object"], _library(self.root))
        return self._loaded[k]
