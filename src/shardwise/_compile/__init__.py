"""`shardwise.compile`: trace a function on DTensors once per signature, then replay its local program.

One room per piece, each importing only the ones above it in this list:

| module | holds |
|---|---|
| `_host` | `shardwise::host`: host work (a pipeline's messages, a ring's rotation) as one graph node, run at every replay |
| `_trace` | `Trace` and `collectives_as_nodes()`: while a trace runs, collectives become `shardwise::collective` nodes; `current_trace()` for code that files host work or refuses the trace |
| `_optim` | SGD, Adam and AdamW traced on their fused kernels, the learning rate a graph input |
| `_signature` | what a call is keyed on, and the slots (parameters, gradients, optimizer state) it reads besides its arguments |
| `_refusal` | why a traced graph cannot be replayed; tensors it reads from outside its arguments (`mark_persistent`) |
| `_replay_code` | a traced graph as one plain Python function calling each op's C++ entry point |
| `_program` | `Program`: one traced signature, run on local tensors and wrapped back into DTensors |
| `_function` | `compile` and `CompiledFunction`: trace, check, keep, replay (the semantics, in its docstring) |

It sits above the DTensor layer (`_tensor`) and the collectives (`_comm`) and imports down:
the `shardwise::collective` op is the door's (`_comm/_traced.py`), since the door is its
kernel and `torch.compile`'s path starts there. A pipeline's step under a trace is the
pipeline's (`pipeline/_replay.py`). Other packages import from this package, never from its
modules.
"""

from ._trace import Trace, current_trace
from ._refusal import mark_persistent
from ._function import MAX_SIGNATURES, CompiledFunction, compile

__all__ = ["MAX_SIGNATURES", "CompiledFunction", "Trace", "compile", "current_trace", "mark_persistent"]
