"""What the tests (``envloop_pipelines_tests/``) and the benchmarks (``bench/``) both stand on.

* :mod:`~envloop_pipelines.testing.services`: a free loopback port, a real ``mlflow server``, a real
  ``dagster-webserver`` serving this package's definitions;
* :mod:`~envloop_pipelines.testing.serve`: a small real checkpoint and the policy server as its own process;
* :mod:`~envloop_pipelines.testing.scripted_agents`: scripted agents (a solver, a hostile agent, broken
  replies) behind a real OpenAI-compatible HTTP server;
* :mod:`~envloop_pipelines.testing.environments`: environment specs of the shell families and a decision question.

Plain Python, no pytest: a bench script imports it as any user would. The pipeline itself never does
(``envloop_pipelines_tests/test_import_direction.py``).
"""
