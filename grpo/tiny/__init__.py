"""The models built in code, for runs and tests without a download: the tiny text policy (text.py), the
tiny VLM (vlm.py), their warm start and cache (warm_start.py), the tiny reward model (rm.py), and the
folder a run's `model.path` names (folders.py).

Layers: text.py, vlm.py and warm_start.py know no task and no rollout engine (the task, and a
multi-turn task's `play`, are handed in); folders.py and rm.py sit above the tasks and build them;
guess.py plays the guess task's episodes for its warm start. tests/test_layering.py holds the rules.
"""
