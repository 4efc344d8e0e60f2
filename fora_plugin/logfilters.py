"""Third-party log lines that every run would print although they concern nothing the user set.

Each is dropped by its exact text on its own logger only; every other message of those loggers still shows. The
bitsandbytes one is logged while PEFT imports bitsandbytes, which ``import fora_plugin`` does: the package imports
this module first, so its filter is in place before that.

May import: nothing of fora_plugin.
"""

from __future__ import annotations

import logging


__all__ = ["BNB_KERNEL_LOGGER", "BNB_KERNEL_MESSAGE", "DropMessage", "drop"]

# bitsandbytes' optional CPU kernel package (`kernels`), which FoRA does not need.
BNB_KERNEL_LOGGER = "bitsandbytes.backends.cpu.ops"
BNB_KERNEL_MESSAGE = "Failed to load CPU gemm_4bit_forward from kernels-community"


class DropMessage(logging.Filter):
    """Drops the records of one logger whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def drop(logger_name: str, prefix: str) -> None:
    """Drop ``logger_name``'s messages that start with ``prefix`` (once: calling it again adds nothing)."""
    target = logging.getLogger(logger_name)
    if not any(isinstance(f, DropMessage) and f.prefix == prefix for f in target.filters):
        target.addFilter(DropMessage(prefix))


drop(BNB_KERNEL_LOGGER, BNB_KERNEL_MESSAGE)
