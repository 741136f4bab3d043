"""The multi-process serving runner: model, rank processes (and, later, schedulers and the
front end). Imports torch; ``import shmkv`` does not import this package."""
