"""pcd_engine: typed classification with parallel constrained decoding (PCD).

The core knows nothing of LangChain or LlamaIndex; adapters live in `minicpm_pcd_adapters` and use
only the names exported here: the engine, what its methods return or raise, and the schema helpers
adapters need before any model work.

The names are listed once, in `__init__.pyi`, and each is imported from its module on first use
(`lazy_loader`, SPEC 1 of the Scientific Python project): `from pcd_engine import PCDError` does not
import PyTorch or transformers, so the `pcd` commands check their arguments and refuse bad input in
a fraction of a second, before anything heavy loads. `EAGER_IMPORT=1` imports everything at once.
"""

import lazy_loader

__getattr__, __dir__, _names = lazy_loader.attach_stub(__name__, __file__)
__all__ = [*_names, "__version__"]
__version__ = "0.1.0"
