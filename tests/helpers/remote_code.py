"""A preamble for scripts that must run as a user without mm_fusion would: it makes `import mm_fusion` fail."""

import textwrap


BLOCK_MM_FUSION = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class BlockMMFusion(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "mm_fusion" or name.startswith("mm_fusion."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, BlockMMFusion())
    """
)
