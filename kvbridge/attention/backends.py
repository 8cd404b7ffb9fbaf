"""The backends ``sparse_decode`` accepts, without torch (the command line's ``--backend`` choices)."""

#: ``auto`` (FlashMLA's kernel where it runs, else the reference), ``reference``, ``flashmla``.
BACKENDS = ("auto", "reference", "flashmla")
