"""Optional packages: imported where used, with an error that says which extra installs them."""
from __future__ import annotations

import importlib

WAN_EXTRA = 'pip install -e ".[wan]"'


def require(module: str, what: str, install: str = WAN_EXTRA):
    """`module` imported, or an ImportError saying that `what` needs it and how to install it. A package that
    is installed but fails to import is most often shadowed by a folder of the script's own directory
    (experiments/kernels hides the `kernels` package diffusers imports): that error says so."""
    package = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and err.name.split(".")[0] == package:
            raise ImportError(f"{what} needs {package}: {install}") from None
        raise ImportError(f"{what}: {package} is installed but could not be imported ({err}); run the script as a "
                          f"module from the repository root, python -m experiments.<name>") from err
    except ImportError as err:
        raise ImportError(f"{what}: {package} is installed but could not be imported ({err}); run the script as a "
                          f"module from the repository root, python -m experiments.<name>") from err
