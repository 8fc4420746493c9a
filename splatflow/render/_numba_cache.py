"""Where numba caches the compiled kernels: one cache per version of the kernel sources, whatever path they are
imported through.

``splatflow.pipeline.runtime_env`` points ``NUMBA_CACHE_DIR`` at ``render/__pycache__/numba-<hash of the kernel
sources>`` (resolved, so a project that links ``splatflow/`` to a checkout uses the checkout's folder). Inside it numba
files each source file's kernels under a sub-folder named after the file's directory *as imported*: the same
kernels imported through a symbolic link (the test projects link ``splatflow/`` to the checkout so that DVC can
hash it) landed in a new sub-folder and compiled again, ~42 s of CPU per project, and so did the copies of the
workspace that DVC's temporary and queued experiments run in. The locator installed here files splatflow's
kernels under one sub-folder name (other packages' kernels under their resolved directory). The cache stays
checked by numba's own stamp of each source file (a hash of its content), so a changed file still recompiles.

numba picks a function's locator when the function is decorated, so :func:`install` runs when
``splatflow.render`` is imported, before any kernel module. It extends numba's internal list of locators (present
under these names from numba 0.59 to 0.68); on a numba without them it does nothing and numba's default applies.
"""

from __future__ import annotations

import os


def install() -> bool:
    """Put the resolved-path locator first in numba's locator list (once); True if it is installed."""
    try:
        from numba.core import caching
    except ImportError:  # pragma: no cover - numba is a dependency
        return False
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    base = getattr(caching, "UserProvidedCacheLocator", None) or getattr(caching, "_UserProvidedCacheLocator", None)
    classes = getattr(impl, "_locator_classes", None)
    if base is None or not isinstance(classes, list):
        return False
    if any(getattr(c, "splatflow_resolved", False) for c in classes):
        return True

    class ResolvedPathLocator(base):
        """numba's ``NUMBA_CACHE_DIR`` locator, with the sub-folder named after the resolved source directory."""

        splatflow_resolved = True

        @classmethod
        def get_suitable_cache_subpath(cls, py_file):
            real = os.path.realpath(py_file)
            folder = os.path.dirname(real)
            if os.path.basename(folder) == "render" and os.path.basename(os.path.dirname(folder)) == "splatflow":
                # splatflow's kernels: one name wherever the checkout is (a linked project, a DVC experiment's
                # copy); the cache folder is already per version of these sources, and numba re-checks each file
                return "splatflow_render"
            return super().get_suitable_cache_subpath(real)

    classes.insert(0, ResolvedPathLocator)
    return True
