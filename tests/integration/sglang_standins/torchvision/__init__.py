"""asyncrl's import-only stand-in for torchvision, installed into the venv by sglang_venv.py.

The PyPI torchvision wheels are built against PyPI's CUDA torch, and a CPU build for the venv's
torch 2.13.0+cpu is not published; installing one pulls CUDA torch back in. SGLang imports
torchvision at start-up in modules for multimodal models (its configs package imports the InternVL
and DeepSeek-OCR helpers, for example) but never calls it when serving a text model. So this
package only makes those imports succeed: `transforms.InterpolationMode` is a real enum (its
members are read at import time), and every other name is a placeholder class that raises a
NotImplementedError when called or instantiated. Serving an image or video model needs the real
torchvision.
"""

from __future__ import annotations

__version__ = "0+asyncrl.standin"  # a valid version string, older than any real torchvision


def missing_names(module: str):
    """A module-level __getattr__ for `module`: each name is a placeholder class whose use
    raises (a class, so that module-level subclassing and isinstance checks still work)."""

    def __getattr__(name: str):
        if name.startswith("__"):  # keep Python's protocol look-ups (__all__, __path__) normal
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise NotImplementedError(
                f"{module}.{name} is not available: this torchvision is asyncrl's import-only "
                "stand-in (tests/integration/sglang_standins); serving image or video models "
                "needs the real torchvision")

        return type(name, (), {"__new__": unavailable, "__module__": module})

    return __getattr__


__getattr__ = missing_names(__name__)

from torchvision import io, transforms  # noqa: F401  (as the real package does, after the above)
