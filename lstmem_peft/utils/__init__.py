"""The ground floor: user-facing errors, optional dependencies, and tiny offline models and
tokenizers. Imports nothing else of the package."""
