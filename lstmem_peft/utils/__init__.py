"""The ground floor: user-facing errors, optional dependencies, tiny offline models and
tokenizers, and the catalogue of adapters shipped in the package. Imports nothing else of the
package."""
