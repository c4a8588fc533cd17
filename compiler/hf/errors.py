"""The Hugging Face frontend's errors: one base class, one subclass per kind of failure."""

from __future__ import annotations

from thin.ir import ThinError


class FrontendError(ThinError):
    """Any failure to turn a checkpoint directory into IR."""


class UnsupportedArchitectureError(FrontendError):
    """config.json names an architecture no adapter handles."""


class PickleCheckpointError(FrontendError):
    """The checkpoint is only available as pickle (.bin/.pt), which is never loaded."""


class CheckpointError(FrontendError):
    """A file is missing, unreadable, truncated or inconsistent with its index."""


class UnsupportedConfigError(FrontendError):
    """A config value that changes the model's math is not supported by the adapter."""


class LedgerError(FrontendError):
    """Source tensors were neither consumed by the adapter nor declared unused."""


class OutsideModelFolderError(CheckpointError):
    """A file name or symlink leads outside the model folder (absolute path, '..', a link elsewhere)."""


class InputChangedError(CheckpointError):
    """An input file changed while the compile was reading it."""


class ConfigMismatchError(FrontendError):
    """config.json describes a model the weights do not fit (shapes, counts), so the IR does not verify."""


class AuxiliaryFileError(CheckpointError):
    """A tokenizer, chat template or generation config file is not what it claims to be."""
