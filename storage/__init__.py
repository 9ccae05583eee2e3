"""storage service: the trajectory lake (Parquet parts in the object store), its replay and run metadata, and the storage sink (see docs/ARCHITECTURE.md)."""
