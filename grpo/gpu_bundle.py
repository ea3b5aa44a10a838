"""`make gpu-bundle`: vLLM 0.26.0 and what it needs, packed into carry-sized parts for a lent GPU machine
that reaches no package index (../shared/GPU_VLLM.md step 0; docs/gpu.md, "The lent GPU machine").

The lent machine has Python 3.12, torch 2.11.0+cu130 and transformers 5.17, and takes at most 64 MiB of
files per call (the checkout's own, about 3 MiB, included). vLLM 0.26.0 is the newest release that pins
exactly that torch and is a CUDA 13 build; trimmed for Hopper it packs with the small wheels it lacks
there into about 100-110 MiB of `.tar.xz`: two calls. On this machine, with an index:

    pip wheel --no-deps -w dist/trainer_wheels <TRAINER at this checkout's versions>  # printed by build
    python -m grpo.gpu_bundle build dist/gpu_bundle --add dist/trainer_wheels dist/grpo_cache [--keep-moe]

    1. download  `pip download --no-deps` of vLLM 0.26.0, the 78 lean wheels and 11 insurance wheels
                 it needs beyond the image (cp312, manylinux_2_35 and older tags)
    2. trim      vLLM's wheel without FA2 (H100/H200 run FA3), the Rust frontend, deep_gemm for other
                 Pythons and, unless --keep-moe, the MoE kernels (a dense model never loads them)
    3. install   `pip install --no-index --no-deps --target site/` of every wheel: nothing to resolve there;
                 then `missing`: every requirement is in site/, on the image (IMAGE) or in LEFT_OUT
    4. pack      site/ (and each --add folder, under its own name) as one payload.tar.xz
    5. split     the payload into parts of at most PART_BYTES, one carry folder per call
                 (call1/, call2/, ...), each within CALL_BYTES with the checkout's files (measured,
                 `carry_budget`), with SHA256SUMS and manifest.json in the last; `bundle_calls` prints
                 the calls to make (`calls` checks them against the checkout again)

On the GPU machine (scripts/gpu_bundle_go.sh): each call but the last copies its parts to /tmp/gpu_stage,
the last checks every checksum, unpacks into /tmp/gpu_site and runs the command it is given with
PYTHONPATH=/tmp/gpu_site. The calls must follow each other within the machine's 30 s idle window.

Standard library only (with pip, `packaging` and, if present, the `xz` tool for a two-thread compression).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from grpo.wheelhouse import platform_tags

MiB = 2**20
CALL_BYTES = 64 * MiB  # what one `run` call takes: the checkout's files and the carried folders together
SPARE_BYTES = MiB  # for the checkout's growth between the build and the calls (checked again by `calls`)
PART_BYTES = 60 * MiB  # a part at most, leaving the carry folder room for SHA256SUMS and manifest.json
ROOT = Path(__file__).resolve().parent.parent
PYTHON_VERSION = "3.12"  # the lent machine's
# The image's glibc is unrecorded (Python 3.12.3 suggests Ubuntu 24.04, glibc 2.39; gpu_bundle_go.sh logs
# `ldd --version`); vLLM 0.26.0 itself is manylinux_2_28, but llguidance 1.7.6 has no wheel below 2_31
# (seen: "No matching distribution" at 2_28). Every older tag follows (platform_tags).
PLATFORM = "manylinux_2_35_x86_64"
VLLM = "vllm==0.26.0"

# The wheels vLLM 0.26.0 imports (or its API server does) that the image lacks: ../shared/GPU_VLLM.md section 2,
# read from the wheel's METADATA against the image's package list.
LEAN = """
annotated-types==0.8.0 anthropic==2.14.0 astor==0.8.1 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0
cffi==2.1.1 compressed-tensors==0.17.0 cryptography==50.0.2 depyf==0.20.0 dill==0.4.1 dnspython==2.9.2
docstring_parser==0.18.0 email-validator==2.4.0 fastapi==0.136.3 fastapi-cli==0.0.34
googleapis-common-protos==1.76.0 httpcore2==2.16.2 httptools==0.9.0 httpx2==2.16.2 ijson==3.6.0
interegular==0.3.3 jiter==0.19.0 jmespath==1.1.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
lark==1.2.2 llguidance==1.7.6 lm-format-enforcer==0.11.3 loguru==0.7.3 mcp==2.3.0 mcp-types==2.3.0
mistral_common==1.13.1 model-hosting-container-standards==0.1.16 msgspec==0.22.0 openai==3.57.0
openai-harmony==0.0.8 opentelemetry-api==1.45.2 opentelemetry-exporter-http-transport==0.66b2
opentelemetry-exporter-otlp==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2
opentelemetry-semantic-conventions==0.66b2 opentelemetry-semantic-conventions-ai==0.5.1 outlines_core==0.2.14
partial-json-parser==0.2.1.1.post7 prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1
pycountry==26.2.16 pycparser==3.12 pydantic==2.14.4 pydantic-extra-types==2.11.1 pydantic-settings==2.16.3
pydantic_core==2.50.5 PyJWT==2.15.1 python-dotenv==1.2.4 python-json-logger==4.2.0 python-multipart==0.0.34
pyzmq==27.3.0 referencing==0.37.0 rich-toolkit==0.20.6 rpds-py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1
sse-starlette==3.7.0 starlette==1.10.0 supervisor==4.3.0 truststore==0.10.5 typing-inspection==0.4.5
uvicorn==0.54.0 watchfiles==1.3.0 websockets==17.4 xgrammar==0.2.7
apache-tvm-ffi==0.1.15.post2
""".split()  # apache-tvm-ffi: xgrammar 0.2.7 imports it (missed until the first GPU call, 2026-11-28; `missing` now checks)
# On the image by name at unknown versions, below floors vLLM or pydantic set: cheap to bring (4.7 MiB).
INSURANCE = """
typing_extensions==4.16.0 aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 frozenlist==1.8.0
aiosignal==1.4.0 aiohappyeyeballs==2.7.1 protobuf==6.33.6 anyio==4.16.0 filelock==4.3.1
""".split()


# The image's packages by name, from `pip list` on the lent H200 (2026-11-28, gpu_bundle_go.sh's piplist.txt,
# less the bundle's own): what the bundle's requirements may rely on being there.
IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless opt-einsum opt-einsum-fx optax optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil py-cpuinfo pyarrow pybind11 pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentence-transformers sentencepiece setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torch-geometric torchaudio torchdiffeq torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
# vLLM 0.26.0 requirements the bundle leaves out on purpose (size), each with what stands in for it. Only
# flashinfer-python is known to be reached by a dense model: gpu_bundle_go.sh sets VLLM_USE_FLASHINFER_SAMPLER=0
# (the sampler's probe imports it otherwise, topk_topp_sampler.py:44); attention is FA3 (bf16) or TRITON_ATTN
# (fp32) on sm90. The rest serve quantized, MLA, video or other kernels' models, or tracing (not seen imported).
LEFT_OUT = {
    "flashinfer-python": "VLLM_USE_FLASHINFER_SAMPLER=0 (gpu_bundle_go.sh)",
    "fastsafetensors": "load_format=fastsafetensors only",
    "humming-kernels": "other models' kernels", "quack-kernels": "other models' kernels",
    "tilelang": "other models' kernels", "tokenspeed-mla": "MLA models (DeepSeek)",
    "nvidia-cutlass-dsl": "other models' kernels", "nvidia-cudnn-frontend": "other models' kernels",
    "nvtx": "layer-wise NVTX tracing only", "pynvvideocodec": "video inputs", "torchcodec": "video inputs",
}
TARGET_ENV = {"python_version": PYTHON_VERSION, "python_full_version": PYTHON_VERSION + ".3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def missing(site: Path, image: frozenset[str] = IMAGE, left_out: dict[str, str] = LEFT_OUT) -> list[str]:
    """Every requirement of a distribution installed in `site` (its METADATA's Requires-Dist, markers
    evaluated for the lent machine, extras skipped) that neither `site`, the image nor `left_out` holds,
    as "requirer needs requirement". The build stops on any: `pip install --no-deps` would not say."""
    from packaging.requirements import Requirement  # local: for the build only (never pip's vendored copy: importing pip turns setuptools' distutils shim off for the process)

    metas = sorted(site.glob("*.dist-info/METADATA"))
    have = {norm(m.parent.name.split("-")[0]) for m in metas} | {norm(n) for n in image} | {norm(n) for n in left_out}
    out = []
    for meta in metas:
        text = meta.read_text(errors="replace").split("\n\n")[0]  # the headers, not the description
        requirer = meta.parent.name.removesuffix(".dist-info")
        for line in text.splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is not None and not req.marker.evaluate(TARGET_ENV):
                continue
            if norm(req.name) not in have:
                out.append(f"{requirer} needs {req}")
    return out


def dropped(member: str, keep_moe: bool = False) -> bool:
    """A member of vLLM's wheel that a dense model on H100/H200 never loads: FA2 (sm90 picks FA3,
    vllm/v1/attention/backends/fa_utils.py), the optional Rust frontend, deep_gemm's builds for other
    Pythons than 3.12, and (unless `keep_moe`) the MoE kernels (imported under suppress(ImportError))."""
    return (member.endswith("/_vllm_fa2_C.abi3.so") or member.endswith("vllm/vllm-rs")
            or re.search(r"deep_gemm/_C\.cpython-3(10|11|13|14)-", member) is not None
            or (not keep_moe and "/_moe_C" in member))


def trim_wheel(src: Path, dst: Path, keep_moe: bool = False) -> list[str]:
    """`src` rewritten to `dst` without the `dropped` members, its RECORD without their lines (so pip
    installs it without complaint); returns the members dropped."""
    gone = []
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w") as zo:
        for info in zi.infolist():
            if dropped(info.filename, keep_moe):
                gone.append(info.filename)
                continue
            data = zi.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not dropped(line.split(",")[0], keep_moe)]
                data = ("\n".join(kept) + "\n").encode()
            zo.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return gone


def target_options(python_version: str = PYTHON_VERSION, plat: str = PLATFORM) -> list[str]:
    """pip's options for wheels of another machine: binary only, its Python and every platform tag it takes."""
    return ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
            *[arg for tag in platform_tags(plat) for arg in ("--platform", tag)]]


def download_command(folder: Path, pins: list[str], python_version: str = PYTHON_VERSION, plat: str = PLATFORM) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", *target_options(python_version, plat),
            "-d", str(folder), *pins]


def install_command(site: Path, wheels: list[Path], python_version: str = PYTHON_VERSION, plat: str = PLATFORM) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
            *target_options(python_version, plat), "--target", str(site), *map(str, wheels)]


def pack(folders: dict[str, Path], payload: Path) -> None:
    """Each folder under its name in one `.tar.xz`: the system's `xz -6 -T2` when there is one (the FA3
    fatbin is repetitive: 145 MiB raw packs to about 9), else Python's lzma (one thread, slower)."""
    if shutil.which("xz"):
        with tempfile.TemporaryDirectory() as tmp:
            tar = Path(tmp) / "payload.tar"
            with tarfile.open(tar, "w") as t:
                for name, folder in folders.items():
                    t.add(folder, arcname=name)
            with open(payload, "wb") as out:
                subprocess.run(["xz", "-6", "-T2", "-c", str(tar)], stdout=out, check=True)
        return
    with tarfile.open(payload, "w:xz", preset=6) as t:
        for name, folder in folders.items():
            t.add(folder, arcname=name)


def checkout_bytes(root: Path = ROOT) -> int:
    """What a `run` call copies besides its carried folders: the checkout's tracked files and the untracked
    ones git does not ignore (the device README's "working tree"). 3.1 MiB at 2026-11-30, not the 2 MB
    the carry was first sized for."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"the bundle is sized for the checkout a call copies beside it, and `git ls-files` in {root} "
                         f"failed ({e}): build it from a git clone of the project.") from None
    return sum((root / name).stat().st_size for name in set(listed) if name and (root / name).is_file())


def carry_budget(checkout: int) -> tuple[int, int]:
    """(part_bytes, carry_bytes) for a checkout of `checkout` bytes: a call folder gets what CALL_BYTES
    leaves after the checkout and SPARE_BYTES, a part 1 MiB less (for the checksums and the manifest)."""
    carry = CALL_BYTES - checkout - SPARE_BYTES
    if carry < 8 * MiB:
        raise SystemExit(f"the checkout holds {checkout / MiB:.1f} MiB of files a call copies: too little of the "
                         f"{CALL_BYTES // MiB} MiB is left for the bundle; remove large untracked files (or ignore them in .gitignore).")
    return min(PART_BYTES, carry - MiB), carry


def split(payload: Path, out: Path, part_bytes: int, carry_bytes: int) -> dict:
    """`payload` cut into parts of at most `part_bytes`, one carry folder per call (out/call1, call2, ...),
    each at most `carry_bytes` with the last one's SHA256SUMS and manifest.json. Returns the manifest:
    the payload's size and checksum, and per call its folder and parts (name, bytes, sha256)."""
    if part_bytes > carry_bytes - MiB:
        raise ValueError(f"part_bytes={part_bytes} leaves no room in a carry of {carry_bytes} bytes for the checksums")
    size = payload.stat().st_size
    calls, whole = [], hashlib.sha256()  # the payload's checksum, in the same one read as the parts'
    with open(payload, "rb") as f:
        for i in range(max(1, -(-size // part_bytes))):
            folder = out / f"call{i + 1}"
            folder.mkdir(parents=True, exist_ok=True)
            part = folder / f"part.{i:02d}"
            data = f.read(part_bytes)
            whole.update(data)
            part.write_bytes(data)
            calls.append({"folder": str(folder.relative_to(out)), "parts": [
                {"name": part.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}]})
    manifest = {"payload": payload.name, "bytes": size, "sha256": whole.hexdigest(), "calls": calls}
    last = out / calls[-1]["folder"]
    (last / "SHA256SUMS").write_text("".join(f"{p['sha256']}  {p['name']}\n" for c in calls for p in c["parts"]))
    (last / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for c in calls:
        used = sum(p.stat().st_size for p in (out / c["folder"]).iterdir())
        if used > carry_bytes:
            raise ValueError(f"{c['folder']} holds {used} bytes, over the {carry_bytes} one call carries")
    return manifest


def check_fits(out: Path, manifest: dict, checkout: int) -> None:
    """Before the calls: each call folder with the checkout as it is now (it may have grown since the
    build) within CALL_BYTES; a call over it is refused on the device after its start, device time lost."""
    for c in manifest["calls"]:
        used = sum(p.stat().st_size for p in (out / c["folder"]).iterdir())
        if used + checkout > CALL_BYTES:
            raise SystemExit(f"{out / c['folder']} ({used / MiB:.2f} MiB) with the checkout's {checkout / MiB:.2f} MiB is over "
                             f"the {CALL_BYTES // MiB} MiB a call takes: rebuild the bundle (`make gpu-bundle`), which sizes "
                             "the parts for the checkout as it is, or remove large untracked files.")


def bundle_calls(manifest: dict, root: str, command: str = "bash scripts/gpu_vllm_run.sh") -> list[dict]:
    """The `run` calls that bring the bundle over, in order: `carry` (relative to the checkout) and the
    command; the last one checks, unpacks and runs `command` on the unpacked site."""
    calls = manifest["calls"]
    out = []
    for i, c in enumerate(calls):
        carry = f"{root}/{c['folder']}"
        if i < len(calls) - 1:
            cmd = f"mkdir -p /tmp/gpu_stage && cp {carry}/part.* /tmp/gpu_stage/ && ls -l /tmp/gpu_stage && nvidia-smi -L"
        else:
            cmd = f"bash scripts/gpu_bundle_go.sh {carry} {command}"
        out.append({"carry": [carry], "command": cmd})
    return out


def build(out: Path, adds: list[Path], keep_moe: bool, python_version: str, plat: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-bundle-", dir=out))
    wheels, site = work / "wheels", work / "site"
    subprocess.run(download_command(wheels, [VLLM, *LEAN, *INSURANCE], python_version, plat), check=True)
    (vllm_wheel,) = wheels.glob("vllm-*.whl")
    trimmed = work / vllm_wheel.name
    gone = trim_wheel(vllm_wheel, trimmed, keep_moe)
    vllm_wheel.unlink()
    print(f"trimmed {vllm_wheel.name}: {len(gone)} members dropped, {trimmed.stat().st_size / MiB:.1f} MiB left")
    subprocess.run(install_command(site, [*sorted(wheels.glob("*.whl")), trimmed], python_version, plat), check=True)
    lacking = missing(site)
    if lacking:
        raise SystemExit("the bundle lacks what its packages need (add each to LEAN in grpo/gpu_bundle.py, or to "
                         "LEFT_OUT with what stands in for it):\n  " + "\n  ".join(lacking))
    folders = {"site": site, **{a.name: a for a in adds}}
    payload = work / "payload.tar.xz"
    pack(folders, payload)
    for old in out.glob("call*"):
        shutil.rmtree(old)
    part_bytes, carry_bytes = carry_budget(checkout_bytes())
    manifest = split(payload, out, part_bytes, carry_bytes)
    shutil.rmtree(work)
    return manifest


# the trainer's own packages the lent machine's image lacks (torch and transformers are the image's):
# scripts/gpu_vllm_run.sh installs them from the bundle's trainer_wheels/, and every step needs them
TRAINER = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "deepspeed", "hjson", "peft")


def check_trainer_wheels(adds: list[Path]) -> None:
    """A bundle for scripts/gpu_vllm_run.sh carries a `trainer_wheels` folder with a wheel of each of
    TRAINER; without it the run's install fails and every grpo step on the GPU with it. Refused here,
    with the command that builds the folder at this checkout's versions."""
    found = next((a for a in adds if a.name == "trainer_wheels"), None)
    names = {re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower() for w in found.glob("*.whl")} if found else set()
    lacking = [n for n in TRAINER if n not in names]
    if lacking:
        pins = " ".join(f"{n}=={importlib.metadata.version(n)}" for n in TRAINER)
        where = f"{found} has no wheel of {', '.join(lacking)}" if found else "no --add folder is named trainer_wheels"
        raise SystemExit(f"--add: {where}; scripts/gpu_vllm_run.sh installs the trainer's packages from it. Build it "
                         f"with `pip wheel --no-deps -w dist/trainer_wheels {pins}` and pass --add dist/trainer_wheels.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo.gpu_bundle", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download, trim, install, pack and split into OUT/call1, call2, ... (needs an index)")
    b.add_argument("out", type=Path)
    b.add_argument("--add", type=Path, nargs="*", default=[], help="folders to bring too, unpacked beside site/ "
                   "(dist/trainer_wheels: the trainer's packages, needed; dist/grpo_cache: the tiny models)")
    b.add_argument("--keep-moe", action="store_true", help="keep vLLM's MoE kernels (about 37 MiB more: a third call)")
    b.add_argument("--python-version", default=PYTHON_VERSION)
    b.add_argument("--platform", default=PLATFORM)
    c = sub.add_parser("calls", help="print the calls for a bundle already built")
    c.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "build":
        for a in args.add:
            if not a.is_dir():
                parser.error(f"--add {a}: no such folder")
        check_trainer_wheels(args.add)
        manifest = build(args.out, args.add, args.keep_moe, args.python_version, args.platform)
    else:
        found = sorted(args.out.glob("call*/manifest.json"))
        if not found:
            parser.error(f"{args.out} holds no call*/manifest.json: run `python -m grpo.gpu_bundle build {args.out}` first")
        manifest = json.loads(found[-1].read_text())
        check_fits(args.out, manifest, checkout_bytes())
    print(f"payload {manifest['bytes'] / MiB:.1f} MiB in {len(manifest['calls'])} call(s); make them back to back "
          f"(the machine goes back after 30 s idle):")
    for i, call in enumerate(bundle_calls(manifest, str(args.out)), 1):
        print(f"  {i}. carry={call['carry']}  command: {call['command']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
