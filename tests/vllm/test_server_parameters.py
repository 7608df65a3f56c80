"""``GET /dcr/parameters`` (every weight's stored bytes) is served only when asked for.

The route hands the whole model to anyone who reaches the engine's port, so the engine process
serves it only with ``--expose-parameters`` or ``DCR_EXPOSE_PARAMETERS=1`` in its environment
(an ``[[engine]] env`` of a fleet file); otherwise it answers 404.  A running engine started
without either answers 404 (``test_vllm_batch``, engine ``c``); the engines whose bits the
tests compare opt in (``test_vllm_batch``, ``test_vllm_catalog``).
"""

from __future__ import annotations

import pytest

from dcr.integrations.vllm.server import EXPOSE_PARAMETERS_ENV, ServerOptions, _parser

pytestmark = pytest.mark.vllm


def test_the_parameters_route_is_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EXPOSE_PARAMETERS_ENV, raising=False)
    assert ServerOptions(model="m").expose_parameters is False
    assert _parser().parse_args(["--model", "m"]).expose_parameters is False
    assert _parser().parse_args(["--model", "m", "--expose-parameters"]).expose_parameters
    for value, exposed in (("1", True), ("0", False), ("", False), ("yes", False)):
        monkeypatch.setenv(EXPOSE_PARAMETERS_ENV, value)
        assert _parser().parse_args(["--model", "m"]).expose_parameters is exposed
