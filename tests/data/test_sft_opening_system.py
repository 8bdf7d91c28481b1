"""The system message that opens every SFT conversation, recorded by a run (run.json's ``sft_system``) so that
``gptoughts sample`` can say to pass it: the model never saw a prompt without one."""

from __future__ import annotations

from gptoughts.data.sft import opening_system


def _conv(system: str | None) -> list[dict[str, str]]:
    head = [{"role": "system", "content": system}] if system is not None else []
    return [*head, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_the_shared_system_message_its_absence_and_several():
    assert opening_system([_conv("Be brief."), _conv("Be brief.")]) == "Be brief."
    assert opening_system([_conv("Be brief."), _conv("Be kind.")]) is True
    assert opening_system([_conv("Be brief."), _conv(None)]) is None
    assert opening_system([]) is None
