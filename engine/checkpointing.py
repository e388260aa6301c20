"""`engine.checkpointing`: DeepSpeed's name (`deepspeed.checkpointing`) for activation checkpointing,
which lives in `engine/activation_checkpointing/`; this module only makes
`from engine.checkpointing import checkpoint` work as well as `engine.checkpointing.checkpoint`."""
from .activation_checkpointing import *  # noqa: F401,F403
from .activation_checkpointing import __all__  # noqa: F401
