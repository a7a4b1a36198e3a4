"""Files in and out: untrusted files opened as data (``files``, ``torchfile``), content digests
(``digest``) and fine-tuning checkpoints (``checkpoint``).
"""
