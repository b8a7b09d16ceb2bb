"""Per-op placement rules, one module per op family. Importing this package registers them all."""

from autotp.ops import registry  # noqa: F401
