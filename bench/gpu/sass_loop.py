"""The instruction mix of gemm_w4a16's chunk loop, read from the SASS of its kernels.

    python3 bench/gpu/sass_loop.py [--cfgs "0,4,8,3,1,2;1,4,8,3,1,2"] [--out FILE.json]   (where nvcc and cuobjdump are)
    python3 bench/gpu/sass_loop.py --nvrtc [--cfgs "1,4,8,3,1,2;4,1,4,8"] [--out FILE.json]   (no GPU, no CUDA toolkit)
    python3 bench/gpu/sass_loop.py --sass FILE.sass [--ptxas FILE.txt] [--out FILE.json]  (a dump made before)

The first form concatenates ``kernels/cuda/common.cuh`` and ``w4a16_mma.cu`` as the op's NVRTC build does, adds
explicit instantiations of ``w4a16_wkc<F16, MT, NWORD, WK, S, XSM, CL>`` (six numbers, ``--cfgs``; the product's
M = 1 and M = 16 kernels at 8192 x 8192 by default), builds them with ``nvcc -cubin -arch=sm_90 -O3 -Xptxas -v``
and dumps the SASS with ``cuobjdump -sass``. (NVRTC, which the op uses, may allocate a few registers differently.)
``--nvrtc`` builds the modules exactly as the op does instead, with the NVRTC library of the ``nvidia-cuda-nvrtc``
wheel (the dev extra; ``shmrpc.kernels._nvrtc``): six numbers name ``w4a16_wkc`` (sm_90), five ``w4a16_wk`` (MT,
NWORD, WK, S, XSM: no cluster), four name ``w4a16_wg`` / ``w4a16_wgc`` (MT, NWORD, S, CL; the wgmma module,
sm_90a), three ``w4a16_wgm`` (MT, S, CL); the dump needs ``cuobjdump`` and ``nvdisasm`` (``pip install
nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm``, or a CUDA toolkit on PATH).
Either way, per kernel it finds the chunk loop (the backward branch whose body holds the most HMMA or HGMMA, the
smallest such body) and counts its instructions by opcode: one pass is one chunk of 64 k for one warp, the next
chunk's copies included. Prints a table and writes JSON (date, command, machine) to ``--out``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[2]
_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9_]+)*)\s*([^;]*);")
_BRA_TARGET = re.compile(r"\b0x([0-9a-f]+)\b")
_FUNCTION = re.compile(r"Function\s*:\s*(\S+)")
_SIG = ("(const u16*, const unsigned char*, const u16*, const u16*, float*, unsigned int*, u16*, "
        "int, int, int, int, int);")


def parse_sass(text: str) -> dict[str, list[tuple[int, str, str]]]:
    """``cuobjdump -sass`` output -> per function (mangled name) its instructions as (address, opcode, operands)."""
    funcs: dict[str, list[tuple[int, str, str]]] = {}
    cur: list[tuple[int, str, str]] | None = None
    for line in text.splitlines():
        m = _FUNCTION.search(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = _INSN.match(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2), m.group(4).strip()))
    return funcs


def chunk_loop(insns: list[tuple[int, str, str]]) -> tuple[int, int, Counter[str]] | None:
    """(start, end, opcode counts) of the loop whose body holds the most HMMA / HGMMA (the smallest of those), or
    None."""
    best: tuple[tuple[int, int], int, int, Counter[str]] | None = None  # ((hmma, -size), start, end, counts)
    for addr, op, args in insns:
        m = _BRA_TARGET.search(args) if op == "BRA" else None
        if m is None or int(m.group(1), 16) >= addr:
            continue
        start = int(m.group(1), 16)
        counts = Counter(o for a, o, _ in insns if start <= a <= addr)
        mma = counts["HMMA"] + counts["HGMMA"]
        key = (mma, start - addr)
        if mma and (best is None or key > best[0]):
            best = (key, start, addr, counts)
    return None if best is None else (best[1], best[2], best[3])


def template_args(mangled: str) -> list[int]:
    """The integer template arguments of a mangled kernel name (``Li4E`` -> 4, ``Lin2E`` -> -2), in order."""
    return [int(v.replace("n", "-")) for v in re.findall(r"Li(n?\d+)E", mangled)]


def registers(ptxas: str) -> dict[str, int]:
    """ptxas -v output -> registers per thread by mangled name (``shmrpc.kernels._nvrtc.registers``)."""
    from shmrpc.kernels._nvrtc import registers as parse

    return parse(ptxas)


def build(cfgs: list[tuple[int, ...]], tmp: Path) -> tuple[str, str]:
    cuda = _ROOT / "kernels" / "cuda"
    src = (cuda / "common.cuh").read_text() + "\n" + (cuda / "w4a16_mma.cu").read_text() + "\n"
    for c in cfgs:
        src += f"template __global__ void w4a16_wkc<F16, {', '.join(map(str, c))}>{_SIG}\n"
    (tmp / "w.cu").write_text(src)
    ptxas = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-std=c++17", "-O3", "-Xptxas", "-v", "-o", "w.cubin", "w.cu"],
                           cwd=tmp, capture_output=True, text=True, check=True).stderr
    sass = subprocess.run(["cuobjdump", "-sass", "w.cubin"], cwd=tmp, capture_output=True, text=True, check=True).stdout
    return sass, ptxas


def build_nvrtc(cfgs: list[tuple[int, ...]], tmp: Path, defs: tuple[str, ...] = (), dtype: str = "F16"
                ) -> tuple[str, str]:
    """The op's own modules (NVRTC, as ``kernels/_cuda.py`` builds them) for ``cfgs`` of activations ``dtype`` (F16 or
    BF16), with the extra options ``defs`` (probe builds: ``-DW4_HALF=1``): (SASS, ptxas's log)."""
    import os

    sys.path.insert(0, str(_ROOT))
    from shmrpc.kernels._cuda import source
    from shmrpc.kernels._nvrtc import OPTIONS, compile_cubin, load, tool
    from shmrpc.kernels._w4a16_config import _wg_name

    lib, cuobjdump, nvdisasm = load(), tool("cuobjdump"), tool("nvdisasm")
    if lib is None or cuobjdump is None or nvdisasm is None:
        raise SystemExit("--nvrtc needs NVRTC, cuobjdump and nvdisasm (pip install nvidia-cuda-nvrtc "
                         "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    wk = tuple(f"w4a16_wk{'c' if len(c) == 6 else ''}<{dtype},{','.join(map(str, c))}>" for c in cfgs if len(c) in (5, 6))
    wg = tuple(_wg_name(dtype, c) for c in cfgs if len(c) in (3, 4))
    sass, logs = "", ""
    env = {**os.environ, "PATH": f"{Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for file, names, arch in (("w4a16_mma.cu", wk, "sm_90"), ("w4a16_mma.cu+w4a16_wg.cu", wg, "sm_90a")):
        if not names:
            continue
        built = compile_cubin(lib, source(file), names, arch, (*OPTIONS, *defs, "--ptxas-options=-v"))
        (tmp / f"{arch}.cubin").write_bytes(built.cubin)
        sass += subprocess.run([cuobjdump, "-sass", f"{arch}.cubin"], cwd=tmp, capture_output=True, text=True,
                               check=True, env=env).stdout
        logs += built.log
    return sass, logs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cfgs", default="0,4,8,3,1,2;1,4,8,3,1,2",
                    help="w4a16_wkc template arguments MT,NWORD,WK,S,XSM,CL (with --nvrtc also w4a16_wg's MT,NWORD,S,CL); "
                         "several separated by ';'")
    ap.add_argument("--nvrtc", action="store_true", help="build as the op does, with NVRTC (no nvcc, no GPU)")
    ap.add_argument("--defs", default="", help="with --nvrtc: extra compile options, space-separated (-DW4_HALF=1)")
    ap.add_argument("--dtype", choices=("F16", "BF16"), default="F16",
                    help="with --nvrtc: the activations' type of the kernels built (default F16)")
    ap.add_argument("--sass", help="analyse this cuobjdump -sass output instead of building")
    ap.add_argument("--ptxas", help="with --sass: the ptxas -v output of the same build (registers)")
    ap.add_argument("--note", default="", help="where a --sass dump came from (recorded in the JSON)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.sass:
        sass = Path(args.sass).read_text()
        ptxas = Path(args.ptxas).read_text() if args.ptxas else ""
    else:
        cfgs = [tuple(int(v) for v in c.split(",")) for c in args.cfgs.split(";")]
        with tempfile.TemporaryDirectory() as tmp:
            if args.nvrtc:
                sass, ptxas = build_nvrtc(cfgs, Path(tmp), tuple(args.defs.split()), args.dtype)
            else:
                if args.defs or args.dtype != "F16":
                    raise SystemExit("--defs and --dtype need --nvrtc")
                sass, ptxas = build(cfgs, Path(tmp))
    regs = registers(ptxas)
    kernels: dict[str, Any] = {}
    for name, insns in parse_sass(sass).items():
        loop = chunk_loop(insns)
        if loop is None:
            continue
        start, end, counts = loop
        kernels[name] = {"template_args": template_args(name), "registers": regs.get(name),
                         "loop": [hex(start), hex(end)], "loop_instructions": sum(counts.values()),
                         "by_opcode": dict(counts.most_common())}
        print(f"{name}: template {template_args(name)}, {regs.get(name)} registers, chunk loop "
              f"{hex(start)}-{hex(end)}: {sum(counts.values())} instructions")
        print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common(16)))
    if args.out:
        sys.path.insert(0, str(_ROOT))
        from shmrpc.bench._report import write_probe

        doc = {"mode": "sass-loop", "kernels": kernels, **({"note": args.note} if args.note else {})}
        write_probe(doc, ["bench/gpu/sass_loop.py", *sys.argv[1:]], args.out)
    return 0 if kernels else 1


if __name__ == "__main__":
    sys.exit(main())
