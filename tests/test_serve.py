"""grpo.serve up to its exec into vLLM (os.execv replaced): what the exec'd server inherits from it,
the signals it ignores and what it says about a missing token."""

from __future__ import annotations

import os
import signal

import pytest

from grpo import serve
from grpo.auth import TOKEN_ENV


class Exec(Exception):
    """Raised where grpo.serve would have become vLLM's server."""


@pytest.fixture
def exec_state(monkeypatch):
    """serve.main(argv) -> (the signal dispositions at the exec, what it printed), the process's
    dispositions and environment restored after."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != TOKEN_ENV})  # main writes into it
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}

    def execv(path, argv):
        raise Exec({s: signal.getsignal(s) for s in before})

    monkeypatch.setattr(serve.os, "execv", execv)
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


def test_the_server_ignores_slurms_time_limit_warnings(exec_state, model_dir):
    """submitit's SIGUSR2 (grpo.launch gives its server and judge jobs the trainer's --signal=USR2@120) and
    the sbatch files' SIGUSR1 are the trainer's to act on; vLLM has no handler for them, so the server
    died at the warning and left its engine processes behind. Ignored before the exec, they stay
    ignored in vLLM and the processes it starts."""
    for s in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, signal.SIG_DFL)
    os.environ[TOKEN_ENV] = "a-token"
    with pytest.raises(Exec) as e:
        serve.main(["--model", model_dir, "--max-model-len", "64"])
    assert e.value.args[0] == {signal.SIGUSR1: signal.SIG_IGN, signal.SIGUSR2: signal.SIG_IGN}


def test_a_loopback_server_without_a_token_warns_that_every_local_user_can_push_weights(exec_state, model_dir, capsys):
    """Loopback without a token is allowed (one user's machine), but on a shared node every user of it
    could push weights (docs/security.md, Known gaps): said at start. With a token, nothing is said."""
    with pytest.raises(Exec):
        serve.main(["--model", model_dir, "--max-model-len", "64"])
    assert "no token (GRPO_SERVE_TOKEN or --token-file): every user of this machine can call its routes, a policy " \
           "server's weight pushes included" in capsys.readouterr().err
    os.environ[TOKEN_ENV] = "a-token"
    with pytest.raises(Exec):
        serve.main(["--model", model_dir, "--max-model-len", "64"])
    assert "no token" not in capsys.readouterr().err
