"""The decision loop: a round's steps from the champion's evaluation to the verdict (``before_training``, ``candidate``, ``promotion_decision``), its setup (``noise_floor``), its typed step records (``step_records``), failure mining, environment synthesis and self-answers.
"""
