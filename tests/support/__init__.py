"""What the tests share: the toy and real models they train, and the real worker processes."""
