"""pcd_engine: typed classification with parallel constrained decoding (PCD).

The core knows nothing of LangChain or LlamaIndex; adapters live in `minicpm_pcd_adapters` and use
only the names exported here: the engine, what its methods return or raise, and the schema helpers
adapters need before any model work.

The names are listed in `__init__.pyi` (which type checkers read), and each is imported from its
module on first use (`lazy_loader`, SPEC 1 of the Scientific Python project): `from pcd_engine
import PCDError` imports neither PyTorch nor transformers, so the `pcd` commands check their
arguments and refuse bad input before transformers and the engine load (about 2 s for `pcd --help`
instead of 6 on a 2-core CPU; PyTorch, which the scoring rules and calibrations import, is most of
what is left). `EAGER_IMPORT=1` imports everything at once.
"""

import lazy_loader

__getattr__, __dir__, _names = lazy_loader.attach_stub(__name__, __file__)
__all__ = [*_names, "__version__"]
__version__ = "0.1.0"
