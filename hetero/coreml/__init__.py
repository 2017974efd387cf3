"""The Neural Engine's lane on disk: the Plan's pieces as Core ML programs (graphs/), their export and manifest, and the backends that run them (Core ML on macOS, the reference executor)."""

import logging as _logging
import platform as _platform

if _platform.system() != "Darwin":
    # Off macOS coremltools logs one warning per missing runtime proxy (and an untested-torch note) at import;
    # building and saving packages needs none of them. Set before any module here imports coremltools.
    _logging.getLogger("coremltools").setLevel(_logging.ERROR)
