"""The tool contract (DESIGN.md §6) that the records and the engine obey; tool authors import
it through `executor.tools`."""
