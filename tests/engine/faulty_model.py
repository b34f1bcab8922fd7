"""A fault planted in the model: its forward pass raises for a batch holding a marked prompt, as a kernel
or memory fault would, so the engine loop's handling of a failing step can be tested with a real engine.

``install`` is a module-level function: ``ProcessLLMEngine(initializer=install)`` plants the fault in the
engine's child process before it loads anything.
"""

from __future__ import annotations

POISON = 49151  # the tiny model's last token id: the tiny greedy runs of these tests never produce it
MARK = [POISON] * 4  # a prompt holding this raises in every forward pass it is part of


class PlantedFault(RuntimeError):
    """What the planted fault raises."""


def planted(forward):
    """``LlamaForCausalLM.forward`` raising ``PlantedFault`` for a batch holding ``MARK``'s tokens."""

    def faulty_forward(self, input_ids, positions, meta, kv_caches):
        if int((input_ids == POISON).sum()) >= len(MARK):
            raise PlantedFault("a planted fault for a marked prompt")
        return forward(self, input_ids, positions, meta, kv_caches)

    return faulty_forward


def install() -> None:
    """Plant the fault in this process's ``LlamaForCausalLM``."""
    from engine.models.llama import LlamaForCausalLM

    LlamaForCausalLM.forward = planted(LlamaForCausalLM.forward)
