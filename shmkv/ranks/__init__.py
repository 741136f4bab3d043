"""What a GPU rank process maps: the shared block tables, their slot mappings and the KV store.

torch is imported here only (``import shmkv`` never imports torch). Imports go down only, to
``shmkv.pool`` and the base modules.
"""
