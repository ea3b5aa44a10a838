"""Faults injected into real runs through the config, as a user would cause them."""

import os
import signal

CALLS = {"n": 0}


def interrupt_on_second_call(completions, samples, **_):
    """A reward function that scores once, then presses Ctrl-C (SIGINT to its own process): the run
    stops mid-step, in the main thread, with its engine up and one weight sync done."""
    CALLS["n"] += 1
    if CALLS["n"] >= 2:
        os.kill(os.getpid(), signal.SIGINT)
    return [0.0] * len(completions)


def sigterm_on_third_call(completions, samples, **_):
    """A reward function that sends SIGTERM (scancel, preemption) to its own process while scoring
    the third step: with steps=3, a stop that arrives during the run's last step."""
    CALLS["n"] += 1
    if CALLS["n"] == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return [0.0] * len(completions)
