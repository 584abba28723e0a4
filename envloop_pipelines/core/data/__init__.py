"""Decision data: records and their validation, tabular import, splits, snapshots, the built-in dataset."""
