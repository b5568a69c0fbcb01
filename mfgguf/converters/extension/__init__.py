"""`extend`'s parts: the finished file and the experts it takes (source.py), the new file laid out and written (newfile.py)."""
