"""The decision loop: one module per asset of its setup and its round, named after the asset (the asset graph is
the map of this folder): ``task_benchmark``, ``noise_floor``; then ``baseline_eval``, ``champion_noise_floor``, ``failure_mining``,
``environment_synthesis``, ``registered_hypothesis``, ``training_dataset_snapshot``, ``lora_checkpoint``,
``independent_reeval``, ``promotion_decision``. Beside them: the typed step records (``step_records``), the
generators (``synthesis``, run in the sandbox by ``generator_worker``), the proposer's levers (``proposer``), a
person's proposal file (``proposals``), self-answers and plots.
"""
