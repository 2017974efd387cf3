"""Which BLAS MLX's CPU backend uses, and putting a fast one from a wheel under it on Linux.

The `mlx[cpu]` wheel links a reference BLAS (netlib, about 2 GFLOP/s for fp32 matmuls with transposed weights,
which is what every Linear layer is). hetero depends on a fast BLAS wheel on Linux (pyproject.toml):

- x86-64: Intel MKL (`mkl`), loaded through its single dynamic library `libmkl_rt`;
- aarch64: NVIDIA Performance Libraries' BLAS (`nvpl-blas`), which runs on any Armv8.1-A or later core.

Both export the unprefixed CBLAS symbols that libmlx.so leaves undefined (`cblas_sgemm`, `cblas_dgemm`,
`cblas_cgemm`); scipy-openblas32/64 export only `scipy_`-prefixed ones and so cannot stand in without a compiled
shim. `apply()`, called by `import hetero` before anything imports `mlx.core`, loads the library with
RTLD_GLOBAL: Python loads extension modules with RTLD_NOW, and the dynamic linker searches the global scope
before libmlx's own dependencies, so libmlx binds its BLAS calls to the wheel's library instead of the bundled one.
Nothing is installed system-wide and no environment variable is needed. On macOS nothing changes (Accelerate
on the CPU, Metal on the GPU).

Threads follow MKL_NUM_THREADS (MKL only), then OMP_NUM_THREADS, then OPENBLAS_NUM_THREADS, so benchmarks that
give each lane one BLAS thread keep control: one thread selects MKL's sequential layer; otherwise, and unasked,
MKL runs on its Intel OpenMP layer over every core, and its dynamic mode (on by default) runs a small product on
one thread, so both cores serve only the products large enough to pay for them. Measured on this project's
2-core x86 machines (MKL 2026.2): a 64 x 64 x 64 product costs 10 us either way, a 512 x 1024 x 3072 one 8.6 ms
against 17 ms on one thread; whole runs of the bundled model decode at 367 against 229 tok/s and prefill 4K tokens
at 3,546 against 3,051 tok/s, the large bench model decodes at 20.0 against 12.0 tok/s (bench/llama_cpp.py, 2
threads against 1, bench/results/llama_cpp*.json). The OpenMP runtime keeps
its default KMP_BLOCKTIME (idle workers wait 200 ms before sleeping): with KMP_BLOCKTIME=0 every parallel product
paid for waking a worker, and the same bundled runs fell to 202 and 1,963 tok/s, below one thread.
NVPL runs its sequential variant (not measured: no aarch64 machine here).
`describe()` reads which library libmlx actually bound `cblas_sgemm` to.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# MKL's threading layers (mkl_service.h)
_MKL_LAYERS = {"intel": 0, "sequential": 1, "gnu": 3}
_REEXEC_MARK = "HETERO_BLAS_REEXEC"  # set in a child that reexec_with_fast_blas() started, so it never loops


@dataclass
class _State:
    kind: str | None = None  # "mkl" | "nvpl" once a library was loaded by this process
    paths: list[str] = field(default_factory=list)  # what was loaded, in order
    layer: str | None = None  # MKL threading layer or NVPL variant
    threads: int | None = None  # the thread count that was asked for, if any
    handle: ctypes.CDLL | None = None
    warned: bool = False
    reason: str | None = None  # why the fast BLAS is not in use, when it is not


_state = _State()


def _linux() -> bool:
    return platform.system() == "Linux"


def _dist_file(dist: str, prefix: str) -> Path | None:
    """The installed file of distribution `dist` whose name starts with `prefix` (a shared library)."""
    from importlib import metadata

    try:
        files = metadata.distribution(dist).files or []
    except (metadata.PackageNotFoundError, OSError, ValueError):
        return None
    for f in sorted(files, key=lambda f: len(f.name)):
        if f.name.startswith(prefix) and ".so" in f.name:
            p = Path(f.locate()).resolve()
            if p.is_file():
                return p
    return None


def wheel_library() -> tuple[str, list[Path]] | None:
    """(kind, paths to load in order) of the fast BLAS wheel for this machine, or None where none is installed."""
    if not _linux():
        return None
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        rt = _dist_file("mkl", "libmkl_rt.so")
        return ("mkl", [rt]) if rt else None
    if machine in ("aarch64", "arm64"):
        core = _dist_file("nvpl-blas", "libnvpl_blas_core.so")
        seq = _dist_file("nvpl-blas", "libnvpl_blas_lp64_seq.so")
        return ("nvpl", [core, seq]) if core and seq else None
    return None


def _kind_of(path: str | os.PathLike) -> str:
    name = Path(path).name
    if name.startswith("libmkl"):
        return "mkl"
    if name.startswith("libnvpl_blas"):
        return "nvpl"
    return "other"


def _requested_threads(kind: str | None) -> int | None:
    """The thread count the environment asks for, else None (the library's own default: every core)."""
    names = ("MKL_NUM_THREADS",) if kind == "mkl" else ()
    for name in (*names, "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        value = os.environ.get(name, "").split(",")[0].strip()
        if value:
            try:
                n = int(value)
            except ValueError:
                continue
            if n > 0:
                return n
    return None


def _warn(message: str) -> None:
    _state.reason = message
    if not _state.warned:
        _state.warned = True
        print(f"hetero: {message}", file=sys.stderr, flush=True)


def _mapped_paths() -> list[str]:
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    seen: dict[str, None] = {}
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            seen.setdefault(parts[5], None)
    return list(seen)


def _setup_mkl(handle: ctypes.CDLL, threads: int | None) -> str:
    """Choose MKL's threading layer before its first call; returns the layer's name."""
    if "MKL_THREADING_LAYER" in os.environ:  # the user chose; libmkl_rt reads it itself
        return os.environ["MKL_THREADING_LAYER"].lower()
    layer = "sequential"
    if threads != 1:
        # the Intel OpenMP runtime from the intel-openmp wheel (an mkl dependency); without it MKL would exit
        omp = _dist_file("intel-openmp", "libiomp5.so")
        try:
            if omp is None:
                raise OSError("intel-openmp is not installed")
            ctypes.CDLL(str(omp), mode=ctypes.RTLD_GLOBAL)
            layer = "intel"
        except OSError:
            pass
    handle.MKL_Set_Threading_Layer(ctypes.c_int(_MKL_LAYERS[layer]))
    if threads is not None and layer != "sequential":
        handle.MKL_Set_Num_Threads(ctypes.c_int(threads))
    return layer


_one_thread_lock = threading.Lock()
_one_thread_users = [0, None]  # callers inside `one_thread`, MKL's thread count before the first of them


@contextmanager
def one_thread() -> Iterator[None]:
    """MKL at one thread inside the block (callers that give each core its own BLAS user, as the prefill
    wavefront's lanes do), its count restored when the last caller inside one ends. Nothing to do for its
    sequential layer or another BLAS."""
    handle = _state.handle if _state.kind == "mkl" and _state.layer != "sequential" else None
    if handle is None:
        yield
        return
    with _one_thread_lock:
        if _one_thread_users[0] == 0:
            _one_thread_users[1] = handle.MKL_Get_Max_Threads()
            handle.MKL_Set_Num_Threads(ctypes.c_int(1))
        _one_thread_users[0] += 1
    try:
        yield
    finally:
        with _one_thread_lock:
            _one_thread_users[0] -= 1
            if _one_thread_users[0] == 0:
                handle.MKL_Set_Num_Threads(ctypes.c_int(_one_thread_users[1]))


def openmp_runtime() -> bool:
    """Whether Intel's OpenMP runtime (MKL's threading layer) is loaded with its symbols global, loading it from the
    intel-openmp wheel if MKL runs sequentially: hetero.host.kernels' parallel loops run on it, in MKL's team."""
    if _state.kind == "mkl" and _state.layer == "intel":
        return True
    omp = _dist_file("intel-openmp", "libiomp5.so")
    try:
        if omp is None:
            return False
        ctypes.CDLL(str(omp), mode=ctypes.RTLD_GLOBAL)
        return True
    except OSError:
        return False


def threads_in_use() -> int:
    """The BLAS's thread count for one product: MKL's own, else what the environment asks, else every usable core."""
    if _state.kind == "mkl" and _state.handle is not None:
        return 1 if _state.layer == "sequential" else int(_state.handle.MKL_Get_Max_Threads())
    return _requested_threads(_state.kind) or usable_cores()


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def apply(library: str | os.PathLike | list | None = None) -> bool:
    """Put the wheel's BLAS under MLX, once per process; True when MLX uses (or will use) it.

    Must run before `mlx.core` is first imported (`import hetero` does it first thing). `library` overrides the
    installed wheel's library (a path, or a list of paths loaded in order); a fallback to MLX's bundled
    reference BLAS is said once on stderr, with the reason.
    """
    if not _linux():
        return False
    if _state.kind is not None:
        return True
    if library is None:
        found = wheel_library()
        if found is None:
            want = "mkl" if platform.machine().lower() in ("x86_64", "amd64") else "nvpl-blas"
            _warn(f"no fast BLAS wheel installed ({want}); MLX runs on its bundled reference BLAS, about 40x slower "
                  f"on prefill (reinstall hetero with pip, or `pip install {want}`)")
            return False
        kind, paths = found
    else:
        paths = [Path(p) for p in (library if isinstance(library, (list, tuple)) else [library])]
        kind = _kind_of(paths[-1])
    if "mlx.core" in sys.modules:
        provider = mlx_blas_library()
        if provider is not None and _kind_of(provider) == kind:  # already under MLX (LD_PRELOAD by a re-exec)
            pass
        else:
            _warn("mlx.core was imported before hetero, so the fast BLAS could not be put under it; MLX runs on its "
                  "bundled reference BLAS (slow). Import hetero before mlx, or run through the `hetero` command")
            return False
    threads = _requested_threads(kind)
    try:
        handles = [ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL) for p in paths]
        layer = None
        if kind == "mkl":
            layer = _setup_mkl(handles[-1], threads)
        elif kind == "nvpl":
            layer = "sequential"
            if threads is not None:
                handles[-1].nvpl_blas_set_num_threads(ctypes.c_int(threads))
    except (OSError, AttributeError) as e:
        _warn(f"could not load the fast BLAS ({e}); MLX runs on its bundled reference BLAS (slow)")
        return False
    _state.kind, _state.paths, _state.layer, _state.threads, _state.handle = (
        kind, [str(p) for p in paths], layer, threads, handles[-1])
    _state.reason = None
    return True


def _mlx_library_path() -> str | None:
    return next((p for p in _mapped_paths() if Path(p).name == "libmlx.so"), None)


def _find_aligned(buf: bytes, needle: bytes, field: int, size: int) -> int | None:
    """Index of the first `size`-byte record of `buf` whose bytes at `field` are `needle`."""
    pos = buf.find(needle, field)
    while pos >= 0:
        if (pos - field) % size == 0:
            return (pos - field) // size
        pos = buf.find(needle, pos + 1)
    return None


def _got_offset(lib: str, symbol: str) -> int | None:
    """Offset, from libmlx's load address, of the GOT slot that holds `symbol`'s resolved address."""
    with open(lib, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:  # 64-bit little-endian only
            return None
        shoff, = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
        f.seek(shoff)
        sections = [struct.unpack_from("<IIQQQQIIQQ", f.read(shentsize)) for _ in range(shnum)]

        def data(sec):
            f.seek(sec[4])
            return f.read(sec[5])

        dynsym = next((s for s in sections if s[1] == 11), None)  # SHT_DYNSYM
        if dynsym is None:
            return None
        strtab, syms = data(sections[dynsym[6]]), data(dynsym)
        name = strtab.find(b"\0" + symbol.encode() + b"\0") + 1
        index = _find_aligned(syms, struct.pack("<I", name), 0, 24) if name > 0 else None
        if index is None:
            return None
        for sec in sorted((s for s in sections if s[1] == 4), key=lambda s: s[5]):  # SHT_RELA, .rela.plt first
            rela = data(sec)
            i = _find_aligned(rela, struct.pack("<I", index), 12, 24)  # high half of r_info = symbol index
            if i is not None:
                return struct.unpack_from("<Q", rela, i * 24)[0]
    return None


def _dladdr(address: int) -> str | None:
    class DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]

    info = DlInfo()
    libc = ctypes.CDLL(None)
    if not libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.fname:
        return None
    return os.path.realpath(info.fname.decode())


def mlx_blas_library() -> str | None:
    """The library that libmlx bound `cblas_sgemm` to (read from its GOT), or None before mlx.core is loaded."""
    lib = _mlx_library_path()
    if lib is None:
        return None
    try:
        offset = _got_offset(lib, "cblas_sgemm")
        maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(lib)]
    except OSError:
        return None
    if offset is None or not maps:
        return None
    ranges = [tuple(int(x, 16) for x in m[0].split("-")) + (int(m[2], 16),) for m in maps]
    base = min(start - file_off for start, _, file_off in ranges if file_off == 0)
    slot = base + offset
    if not any(start <= slot and slot + 8 <= end for start, end, _ in ranges):
        return None  # not where it should be: read nothing rather than fault
    address = ctypes.c_void_p.from_address(slot).value
    return _dladdr(address) if address else None


def mkl_layer_loaded() -> str | None:
    """The threading layer MKL loaded in this process (it does at its first call), from the mapped libraries:
    "sequential", "intel", "gnu" or "tbb"; None before that call."""
    mapped = " ".join(Path(p).name for p in _mapped_paths())
    loaded = [n for n in ("sequential", "intel", "gnu", "tbb") if f"libmkl_{n}_thread" in mapped or
              (n == "sequential" and "libmkl_sequential" in mapped)]
    return loaded[0] if len(loaded) == 1 else None


def _mkl_version(handle: ctypes.CDLL) -> str:
    buf = ctypes.create_string_buffer(256)
    try:
        handle.MKL_Get_Version_String(buf, len(buf))
    except AttributeError:
        return ""
    words = buf.value.decode(errors="replace").split()
    return next((w.split("-")[0] for w in words if w[:1].isdigit()), "")


def _label(path: str) -> str:
    kind = _kind_of(path)
    if kind == "mkl":
        handle = _state.handle or ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL | 4)  # RTLD_NOLOAD: never loads
        layer = mkl_layer_loaded() or _state.layer or "?"
        threads = 1 if layer == "sequential" else handle.MKL_Get_Max_Threads()
        plural = "s" * (threads != 1)
        return f"Intel MKL {_mkl_version(handle)} ({Path(path).name}, {layer} layer, {threads} thread{plural})"
    if kind == "nvpl":
        return f"NVPL BLAS ({Path(path).name})"
    name = Path(path).name
    if "mlx_cpu.libs" in path or name.startswith("libblas-"):
        return f"mlx[cpu] bundled reference BLAS ({name}; slow)"
    if "openblas" in path.lower():
        return f"OpenBLAS ({path}, {os.environ.get('OPENBLAS_NUM_THREADS', 'all')} threads)"
    return f"other BLAS ({path})"


def describe() -> str:
    """One line naming the BLAS MLX's matmuls run on in this process (from the loaded libraries)."""
    if platform.system() == "Darwin":
        return "Accelerate (MLX default)"
    provider = mlx_blas_library()
    if provider is not None:
        return _label(provider)
    if _state.kind is not None:  # loaded, mlx.core not imported yet
        return _label(_state.paths[-1]) + ", loaded before MLX"
    if _mlx_library_path() is None:
        return "none loaded yet (mlx.core not imported)"
    return "unknown (could not read libmlx's binding)"


def in_use() -> bool:
    """Whether MLX's matmuls run (or, before mlx.core is imported, will run) on the wheel's fast BLAS."""
    provider = mlx_blas_library()
    if provider is not None:
        return _kind_of(provider) in ("mkl", "nvpl")
    return _state.kind is not None


def reexec_with_fast_blas(argv: list[str] | None = None) -> None:
    """Make sure this process runs MLX on the wheel's BLAS, restarting it once with LD_PRELOAD if it must.

    `import hetero` has normally done it already, and then this returns at once. Where mlx.core was imported
    first, the process restarts with the wheel's library preloaded, so that a benchmark measures what a user
    gets from a fresh venv. `argv` defaults to sys.argv (pass ["-m", "package.module", ...] for -m).
    """
    if not _linux() or in_use() or os.environ.get(_REEXEC_MARK):
        return
    found = wheel_library()
    if found is None:
        apply()  # says once why not
        return
    preload = ":".join(filter(None, [*map(str, found[1]), os.environ.get("LD_PRELOAD")]))
    env = dict(os.environ, LD_PRELOAD=preload, **{_REEXEC_MARK: "1"})
    print(f"hetero: restarting with {found[1][-1].name} preloaded", file=sys.stderr, flush=True)
    os.execve(sys.executable, [sys.executable, *(argv if argv is not None else sys.argv)], env)
