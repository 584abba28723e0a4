"""How the verifier worker is launched in a sandbox: its command line, environment and limits.

Two callers launch the same worker: the verifier runner
(:class:`~envloop_pipelines.core.verify.runner.VerifierRunner`) at run time, and the
Kubernetes manifest generator (:mod:`.k8s_manifests`), which renders that launch as the
reference Job. Both read it from here, so the sandbox layer never imports the verifier
above it: the worker is named by its module path, a string run with ``python -m``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from envloop_pipelines.core.sandbox.base import SandboxLimits

#: The verifier worker, run as ``python -m`` inside the sandbox (``envloop_pipelines/core/verify/worker.py``).
VERIFIER_WORKER_MODULE = "envloop_pipelines.core.verify.worker"
#: A worker maps ~0.75 GiB of address space importing numpy, scipy and pyarrow (with Arrow's
#: system allocator; mimalloc would reserve another ~0.8 GiB arena up front), then scores.
DEFAULT_WORKER_LIMITS = SandboxLimits(cpu_s=120.0, mem_mb=2048, wall_s=180.0, fsize_mb=16, nofile=256, nproc=64)
#: Arrow's default pool (mimalloc) sizes its up-front reservation to whatever RLIMIT_AS leaves, and
#: a later import then fails to map a shared library; the system allocator reserves nothing.
#: Under RLIMIT_AS, every extra thread's malloc arena (64 MiB of address space each) and BLAS/OpenMP
#: thread buffers eat into the limit; the worker scores on one thread, so it gets one of each.
#: The runner adds ``SandboxCall(package_on_path=True)``: the local backend puts the folder this process imports
#: ``envloop_pipelines`` from on the worker's ``PYTHONPATH``, so it runs the same package however its parent found
#: it (installed, or a checkout where nothing is installed: a lent GPU machine, ``bench/bench_gpu.py``); a
#: container runs its image's install.
WORKER_ENV = {"ARROW_DEFAULT_MEMORY_POOL": "system", "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1",
              "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def verifier_worker_argv(python: str, kind: str, predictions_name: str, *, grader: str, threshold: float,
                         safety_families: Sequence[str], aggregate_only: bool = False,
                         safety_thresholds: Mapping[str, float] | None = None,
                         baseline_safety_thresholds: Mapping[str, float] | None = None) -> list[str]:
    """The verifier worker's command line: labels on stdin (fd 0), the verdict on the result channel.

    Args:
        python: the interpreter inside the sandbox.
        kind: the verifier kind (``rule`` or ``grader``).
        predictions_name: the predictions file's name in the sandbox's working directory.
        grader: the grader kind's scoring model.
        threshold: the grader kind's pass threshold.
        safety_families: families whose false-negative rate the rule report includes.
        aggregate_only: a hidden split: the worker answers with counts and aggregate scores only and
            refuses a predictions file that leaves a question unanswered or invalid.
        safety_thresholds: the predictions' automation thresholds on P(false) per safety family
            (``inf`` defers every question of the family).
        baseline_safety_thresholds: the same for the baseline predictions.
    """
    argv = [python, "-m", VERIFIER_WORKER_MODULE, "--kind", kind, "--predictions",
            predictions_name, "--labels-fd", "0", "--result-fd", "env", "--grader", grader, "--threshold", str(threshold)]
    for family in safety_families:
        argv += ["--safety-family", family]
    for flag, given in (("--safety-threshold", safety_thresholds), ("--baseline-safety-threshold",
                                                                    baseline_safety_thresholds)):
        for family, value in (given or {}).items():
            argv += [flag, f"{family}={float(value)!r}"]
    if aggregate_only:
        argv.append("--aggregate-only")
    return argv


__all__ = ["DEFAULT_WORKER_LIMITS", "VERIFIER_WORKER_MODULE", "WORKER_ENV", "verifier_worker_argv"]
