"""What a GPU rank process maps: the shared block tables, their slot mappings and the KV store.

torch is imported here only (``import shmkv`` never imports torch), and only on first use.
Imports go down only, to ``shmkv.pool`` and the base modules.

- ``tables``: a scheduler's block tables in shared memory (``SharedBlockTables``), with
  ``table_writer`` (the scheduler's row edits and commit) and ``table_header``;
- ``slot_mapping``: slots and token indices of a batch;
- ``kv_store``: the node-wide KV store (``KVStore``), the host tier, and ``transfer``: its
  block copies to and from a device cache;
- ``cuda_ipc``: one CUDA tensor shared by the processes driving a GPU;
- ``block_table``: every public name of the above, where it has always been importable.
"""
