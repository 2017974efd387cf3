"""hetero's version, in a module of its own (it imports nothing), so that any layer may read it: the package
(`hetero.__version__`), `hetero --version`, and the stamp of what a measurement was made with
(`hetero.host.settings.measured_with`)."""

__version__ = "0.1.0"
