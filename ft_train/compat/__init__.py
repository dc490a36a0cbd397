"""The private APIs of other libraries that ft-train relies on, one module per library: nothing
else in ft-train reaches into another library's private names. Each module says what it uses, why
no public API does the same, and the versions it was checked against (pyproject.toml bounds
them); `tests/unit/test_private_apis.py` checks every name each one lists (`PRIVATE_NAMES`) on
the versions installed, and fails naming the one an upgrade removed. Prefect's live in
`flows/prefect_private.py` (`ft_train` never imports Prefect)."""
