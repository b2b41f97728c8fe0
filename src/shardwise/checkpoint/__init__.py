"""Sharded checkpoints that load onto another mesh, layout or number of ranks.

Same calls as `torch.distributed.checkpoint`: `save(state_dict, checkpoint_id=dir)` on
every rank writes each element of each global tensor once (every rank its own pieces, in
its own file); `load(state_dict, checkpoint_id=dir)` fills a state dict in place, every
DTensor in its own mesh and placements, by reading from the files the saved pieces that
overlap what the rank holds. A checkpoint is a directory on a filesystem every rank shares;
it is complete once `metadata.json` is in it, which save writes last. `save_pretrained(model,
path)` writes a Hugging Face model whose parameters are DTensors as a `from_pretrained` directory,
each rank writing its own pieces into the safetensors files (`save(state_dict,
storage_writer=HuggingFaceStorageWriter(path))` does so for any state dict of tensors).
`FileSystemReader` / `FileSystemWriter` read and write torch DCP's own format, and
`shardwise.checkpoint.state_dict` is `torch.distributed.checkpoint.state_dict` for models of
shardwise DTensors (full state dicts gathered, and loaded back into each tensor's layout).
Every format is saved by one transaction (`_transaction`), so `async_save` takes a
`storage_writer` too, and every format keeps the last complete checkpoint until the new one
is whole.

Without a process group it is one process saving and loading whole tensors:

>>> import tempfile, torch
>>> from shardwise import checkpoint
>>> path = tempfile.mkdtemp()
>>> checkpoint.save({"w": torch.arange(6.0).reshape(2, 3), "step": 7}, checkpoint_id=path)
>>> target = {"w": torch.zeros(2, 3), "step": 0}
>>> checkpoint.load(target, checkpoint_id=path)
>>> target["w"][1].tolist(), target["step"]
([3.0, 4.0, 5.0], 7)
>>> checkpoint.load({"w": torch.zeros(3, 2), "step": 0}, checkpoint_id=path)  # doctest: +ELLIPSIS
Traceback (most recent call last):
ValueError: cannot load the checkpoint '...' into this state dict; nothing was loaded:
  - 'w': the checkpoint holds shape (2, 3), the state dict (3, 2): global shapes must match (layouts may differ)
"""

from ._async import SaveFuture
from ._dcp_read import FileSystemReader
from ._dcp_write import FileSystemWriter
from ._hf_pretrained import save_pretrained
from ._hf_read import HuggingFaceStorageReader, load_pretrained
from ._hf_write import HuggingFaceStorageWriter
from ._load import load
from ._transaction import async_save, save

__all__ = ["load", "save", "async_save", "save_pretrained", "HuggingFaceStorageWriter", "HuggingFaceStorageReader", "load_pretrained", "FileSystemReader", "FileSystemWriter"]  # torch.distributed.checkpoint's names (SaveFuture is what async_save returns)
