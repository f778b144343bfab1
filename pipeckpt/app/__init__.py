"""The application around the library: Hydra config schemas, the bundled models and data that
``train.py`` trains."""
