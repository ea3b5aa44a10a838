"""Offline install: every wheel a target machine needs, in one folder, for nodes that reach no package
index. `make wheelhouse` runs `build` on a machine with one; `make setup WHEELHOUSE=<folder>` installs
from the folder with `--no-index` on the target (docs/gpu.md, "Air-gapped install (wheelhouse)").

    python -m grpo.wheelhouse build dist/wheels --profile trainer --python-version 3.12 \\
        --platform manylinux_2_28_x86_64
    python -m grpo.wheelhouse check-torch dist/wheels     # on the target, inside its venv

Profiles (the project's runtime dependencies are read from setup.cfg, never copied here):
  trainer  setup.cfg's install_requires without torch: the trainer with rollout=hf and DeepSpeed.
           Plus pytest (the `gpu` tier), setuptools and wheel (the offline editable install of the
           checkout) and pip (a venv made without ensurepip). No vLLM.
  full     trainer plus vLLM's CUDA build (the Makefile's pin) with its dependencies, for machines
           whose torch is the one vLLM pins.
torch and the CUDA wheels it pulls (nvidia-*, triton) are left out unless --with-torch: the target's
own torch stays. pip resolves against a stand-in torch of --torch-version with no dependencies, so
every other package's torch bound is checked against the version the target has.

Standard library only: it runs on the build machine's Python (and pip), before any venv exists.
"""

from __future__ import annotations

import argparse
import configparser
import os
import platform
import re
import shutil
import site
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ("trainer", "full")
VLLM_GPU = "vllm==0.33.0"  # the Makefile passes its own pin (--vllm); this is the default for direct use
# The torch pip resolves against when the target's is not given: setup.cfg's tested version for the
# trainer, vLLM 0.33.0's pin for `full`.
TORCH_FOR = {"trainer": "2.13.0", "full": "2.14.0"}
STUB_LABEL = "wheelhouse"  # the stand-in torch is version X+wheelhouse: no real release carries it
# Pure-Python packages that PyPI has only as source archives: built here into py3-none-any wheels.
# deepspeed's pin comes from setup.cfg; DS_BUILD_OPS=0 builds no CUDA op (torch's AdamW is used; ops
# it would JIT-compile need nvcc on the target). antlr4's 4.9.x is what hydra-core 1.3.8 and
# omegaconf 2.3 require, and 4.9.3 has no wheel.
SDISTS = {"deepspeed": None, "antlr4-python3-runtime": "antlr4-python3-runtime==4.9.3"}
SDIST_ENV = {"DS_BUILD_OPS": "0"}
REQUIREMENTS = "requirements.txt"  # in the folder: what `make setup WHEELHOUSE=...` installs, and the marker of a wheelhouse


def name_of(requirement: str) -> str:
    """The normalised project name of a requirement line (`Hydra_Core[x]>=1 ; python_version>'3'` -> `hydra-core`)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def _lines(value: str) -> list[str]:
    out = []
    for line in value.splitlines():
        line = line.split("#", 1)[0].strip()  # setup.cfg puts the why after a requirement
        if line:
            out.append(line)
    return out


def setup_cfg_requirements(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """setup.cfg's install_requires and extras_require, comments stripped, in file order."""
    cfg = configparser.ConfigParser(interpolation=None, comment_prefixes=("#", ";"), inline_comment_prefixes=None)
    cfg.read_string(text)
    install = _lines(cfg.get("options", "install_requires", fallback=""))
    extras = {k: _lines(v) for k, v in cfg.items("options.extras_require")} if cfg.has_section("options.extras_require") else {}
    return install, extras


def build_requirements(pyproject_text: str) -> list[str]:
    """pyproject.toml's [build-system] requires: what an editable install of the checkout builds with."""
    match = re.search(r"^\[build-system\].*?^requires\s*=\s*\[(.*?)\]", pyproject_text, re.S | re.M)
    return re.findall(r"""["']([^"']+)["']""", match.group(1)) if match else []


def profile_requirements(profile: str, setup_cfg: str, *, vllm: str = VLLM_GPU, with_torch: bool = False,
                         skip: tuple[str, ...] = ()) -> list[str]:
    """The lines of the folder's requirements.txt: what `make setup WHEELHOUSE=...` installs (the
    checkout itself then goes on with --no-deps). torch only with `with_torch`; `skip` names
    requirements to leave out (what only they pull in goes too)."""
    if profile not in PROFILES:
        raise ValueError(f"profile {profile!r}: one of {', '.join(PROFILES)}")
    install, extras = setup_cfg_requirements(setup_cfg)
    unknown = {name_of(n) for n in skip} - {name_of(r) for r in install}
    if unknown:
        raise ValueError(f"skip: {', '.join(sorted(unknown))} not in setup.cfg's install_requires")
    dropped = {name_of(n) for n in skip} | (set() if with_torch else {"torch"})
    reqs = [r for r in install if name_of(r) not in dropped]
    reqs += [r for r in extras.get("dev", []) if name_of(r) == "pytest"]  # `make test-gpu` on the target
    if profile == "full":
        reqs.append(vllm)
    return reqs


def sdist_requirements(setup_cfg: str) -> list[str]:
    """The pinned source-only packages to build into wheels (deepspeed's pin from setup.cfg)."""
    install, _ = setup_cfg_requirements(setup_cfg)
    pins = {name_of(r): r for r in install}
    out = []
    for name, fixed in SDISTS.items():
        req = fixed or pins.get(name)
        if not req:
            raise ValueError(f"{name} is not in setup.cfg's install_requires; update SDISTS in grpo/wheelhouse.py")
        out.append(req)
    return out


def host_platform() -> str:
    """This machine's manylinux tag from its glibc (`manylinux_2_36_x86_64`); pip also takes the older ones."""
    libc, version = platform.libc_ver()
    if libc != "glibc" or not version:
        raise SystemExit("error: no glibc found here; give --platform (e.g. manylinux_2_28_x86_64)")
    major, minor = version.split(".")[:2]
    return f"manylinux_{major}_{minor}_{platform.machine()}"


LEGACY_MANYLINUX = {(2, 17): "manylinux2014", (2, 12): "manylinux2010", (2, 5): "manylinux1"}


def platform_tags(plat: str) -> list[str]:
    """Every platform tag a wheel for `plat` may carry, newest first. pip's --platform matches only the
    exact tag given, so a manylinux_2_28 target must also name manylinux_2_27 ... manylinux_2_5 and the
    legacy aliases (manylinux2014 = 2_17), or most binary wheels (tagged 2_17) would be skipped."""
    match = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", plat)
    if not match:
        return [plat]
    major, minor, arch = int(match.group(1)), int(match.group(2)), match.group(3)
    tags = []
    for m in range(minor, 4, -1):
        tags.append(f"manylinux_{major}_{m}_{arch}")
        if (major, m) in LEGACY_MANYLINUX:
            tags.append(f"{LEGACY_MANYLINUX[major, m]}_{arch}")
    return tags


def release(version: str) -> tuple[int, ...]:
    """`2.11.0+cu130` -> (2, 11, 0)."""
    return tuple(int(p) for p in re.match(r"\d+(?:\.\d+)*", version).group(0).split("."))


def torch_problem(version: str, spec: str) -> str | None:
    """Why torch `version` falls outside a specifier such as setup.cfg's `torch>=2.13,<2.15`, or None.
    Releases only (local labels such as +cu130 ignored); the operators setup.cfg uses."""
    have = release(version)
    for op, bound in re.findall(r"(>=|<=|==|!=|<|>)\s*([0-9][0-9.]*)", spec):
        want = release(bound)
        n = max(len(have), len(want))
        a, b = have + (0,) * (n - len(have)), want + (0,) * (n - len(want))
        ok = {">=": a >= b, "<=": a <= b, "==": a == b, "!=": a != b, "<": a < b, ">": a > b}[op]
        if not ok:
            return f"torch {version} is outside {spec.replace(' ', '')} ({op}{bound} fails)"
    return None


def _stub_torch(folder: Path, version: str) -> Path:
    """A torch wheel with no files and no dependencies: pip resolves everything else against it."""
    full = f"{version}+{STUB_LABEL}"
    info = f"torch-{full}.dist-info"
    path = folder / f"torch-{full}-py3-none-any.whl"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {full}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: grpo.wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"]))
    return path


def _run(cmd: list[str], env: dict | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})})


def _prepare(dest: Path) -> None:
    """An empty folder, or one this module filled before (its wheels are replaced); nothing else is touched."""
    if dest.exists() and any(dest.iterdir()):
        if not (dest / REQUIREMENTS).exists():
            raise SystemExit(f"error: {dest} is not empty and holds no {REQUIREMENTS} from an earlier build: "
                             f"give an empty or new folder")
        for p in dest.iterdir():
            if p.suffix == ".whl" or p.name == REQUIREMENTS:
                p.unlink()
    dest.mkdir(parents=True, exist_ok=True)


def build(dest: Path, profile: str, python_version: str, plat: str, *, torch_version: str | None = None,
          with_torch: bool = False, vllm: str = VLLM_GPU, skip: tuple[str, ...] = ()) -> None:
    t0 = time.time()
    setup_cfg = (ROOT / "setup.cfg").read_text()
    reqs = profile_requirements(profile, setup_cfg, vllm=vllm, with_torch=with_torch, skip=skip)
    tools = [*build_requirements((ROOT / "pyproject.toml").read_text()), "pip"]
    abi = "cp" + python_version.replace(".", "")
    torch_version = torch_version or TORCH_FOR[profile]
    _prepare(dest)
    pip = [sys.executable, "-m", "pip"]

    # 1. Source-only packages, built here (pure Python: the wheel fits every target Python and platform).
    _run([*pip, "wheel", "--no-deps", "--wheel-dir", str(dest), *sdist_requirements(setup_cfg)], env=SDIST_ENV)
    impure = [p.name for p in dest.glob("*.whl") if not p.name.endswith("-py3-none-any.whl")]
    if impure:
        raise SystemExit(f"error: built wheels that are not pure Python, so not for another target: {impure}")
    t_sdists = time.time() - t0

    # 2. Everything else as binary wheels for the target, resolved with the built ones in the folder.
    with tempfile.TemporaryDirectory() as tmp:
        pinned = []
        if not with_torch:
            _stub_torch(Path(tmp), torch_version)
            pinned = [f"torch=={torch_version}+{STUB_LABEL}"]
        roots = Path(tmp) / "roots.txt"
        roots.write_text("\n".join([*reqs, *tools, *pinned]) + "\n")
        platforms = [a for tag in platform_tags(plat) for a in ("--platform", tag)]
        _run([*pip, "download", "--only-binary=:all:", "--python-version", python_version, *platforms,
              "--implementation", "cp", "--abi", abi, "--dest", str(dest), "--find-links", str(dest),
              "--find-links", tmp, "-r", str(roots)])
    for stub in dest.glob(f"torch-*+{STUB_LABEL}-*.whl"):
        stub.unlink()

    header = [f"# make wheelhouse PROFILE={profile} PY_VERSION={python_version} PLATFORM={plat}"
              f"{' WITH_TORCH=1' if with_torch else ''}{' SKIP=' + repr(' '.join(skip)) if skip else ''} ({date.today().isoformat()}, on {platform.node() or 'this host'})",
              "# Installed by `make setup WHEELHOUSE=<this folder>` with --no-index; the checkout itself then with --no-deps.",
              f"# torch: {'from this folder' if with_torch else f'not here: the target keeps its own (resolved against torch {torch_version})'}"]
    (dest / REQUIREMENTS).write_text("\n".join([*header, *reqs]) + "\n")

    wheels = sorted(dest.glob("*.whl"))
    size = sum(p.stat().st_size for p in wheels)
    print(f"\n{dest}: {len(wheels)} wheels, {size / 2**20:.1f} MiB, built in {time.time() - t0:.0f} s "
          f"(source builds {t_sdists:.0f} s); profile {profile}, Python {python_version}, {plat}")
    for p in sorted(wheels, key=lambda p: -p.stat().st_size)[:5]:
        print(f"  largest: {p.name} {p.stat().st_size / 2**20:.1f} MiB")
    pulled = [n for n in skip if any(name_of(p.name.split("-")[0]) == name_of(n) for p in wheels)]
    if pulled:
        print(f"  note: skipped yet pulled in by another requirement: {', '.join(pulled)}")
    if not with_torch:
        print(f"  torch not included: the target's own torch is used (pip checked the others against {torch_version})")


def check_torch(folder: Path) -> int:
    """On the target, in its new venv: say which torch the install builds on, and stop early (with the
    way out) when there is none and the folder has none either."""
    spec = next((r for r in setup_cfg_requirements((ROOT / "setup.cfg").read_text())[0] if name_of(r) == "torch"), "torch")
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # numpy comes next, from the folder
    try:
        import torch  # torch: may be absent here (the wheelhouse installs it)
    except ImportError:
        if any(not p.name.endswith(f"+{STUB_LABEL}-py3-none-any.whl") for p in folder.glob("torch-*.whl")):
            print(f"torch: none here; it comes from {folder}")
            return 0
        print(f"error: this Python ({sys.executable}) has no torch and {folder} has none (built without WITH_TORCH=1).\n"
              f"  Use the machine's own torch: a venv that sees it (make setup creates one with --system-site-packages,\n"
              f"  or make one yourself, install torch into it, and pass VENV=<it>), or rebuild the wheelhouse with\n"
              f"  WITH_TORCH=1 (torch and its CUDA wheels: several GB).", file=sys.stderr)
        return 1
    problem = torch_problem(torch.__version__, spec)
    print(f"torch {torch.__version__} already here ({os.path.dirname(torch.__file__)}): kept, not replaced")
    if problem:
        print(f"warning: {problem}, setup.cfg's tested range; the checkout is installed with --no-deps on top of it anyway")
    gpu = shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    if gpu and not torch.cuda.is_available():
        print(f"warning: nvidia-smi answers but torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device: "
              f"runs would fall back to gloo and the CPU")
    return 0


def inherit_site(venv: Path) -> int:
    """Run by the Python `make setup` builds VENV from: where that Python is itself a venv (the GPU
    machine's python3 is /opt/torch/.venv, which holds its torch), a venv made from it with
    --system-site-packages sees the base interpreter's packages, not that venv's: a .pth file in
    VENV's site-packages lists this venv's. Nothing otherwise."""
    if sys.prefix == sys.base_prefix:
        return 0
    mine = [p for p in site.getsitepackages() if os.path.isdir(p)]
    target = subprocess.check_output([str(venv / "bin" / "python"), "-c",
                                      "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    Path(target, "zz_inherited_site.pth").write_text("".join(f"{p}\n" for p in mine))
    print(f"{venv} sees the packages of {sys.prefix} (a venv itself): {', '.join(mine)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo.wheelhouse", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download and build the wheels into FOLDER (needs an index)")
    b.add_argument("folder", type=Path)
    b.add_argument("--profile", choices=PROFILES, default="trainer")
    b.add_argument("--python-version", default="%d.%d" % sys.version_info[:2], help="the target's (default: this Python's)")
    b.add_argument("--platform", default=None, help="the target's wheel platform tag (default: this machine's manylinux tag)")
    b.add_argument("--torch-version", default=None, help="the target's torch, that pip resolves the rest against "
                   f"(default: {', '.join(f'{k} {v}' for k, v in TORCH_FOR.items())})")
    b.add_argument("--with-torch", action="store_true", help="include torch and its CUDA wheels (several GB)")
    b.add_argument("--vllm", default=VLLM_GPU, help="the vLLM pin of the full profile")
    b.add_argument("--skip", nargs="*", default=[], metavar="NAME", help="setup.cfg requirements to leave out "
                   "(e.g. datasets math-verify submitit hydra-submitit-launcher, which the trainer imports only on use)")
    c = sub.add_parser("check-torch", help="on the target: which torch the install builds on")
    c.add_argument("folder", type=Path)
    i = sub.add_parser("inherit-site", help="run by the Python VENV was made from: VENV sees that Python's venv packages")
    i.add_argument("venv", type=Path)
    args = parser.parse_args(argv)
    if args.command == "check-torch":
        return check_torch(args.folder)
    if args.command == "inherit-site":
        return inherit_site(args.venv)
    try:
        build(args.folder, args.profile, args.python_version, args.platform or host_platform(),
              torch_version=args.torch_version, with_torch=args.with_torch, vllm=args.vllm, skip=tuple(args.skip))
    except subprocess.CalledProcessError as e:
        print(f"\nerror: pip failed (exit {e.returncode}; its last lines above). A wheel missing for the target is most "
              f"often one built for a newer glibc than --platform says (vLLM 0.33's llguidance 1.7 needs "
              f"manylinux_2_31): run `ldd --version` on the target and give its manylinux_2_NN_<arch>. A package "
              f"published only as source must be pure Python to go into SDISTS in grpo/wheelhouse.py.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
