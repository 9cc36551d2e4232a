"""The Spark edge: the only package that imports pyspark."""
