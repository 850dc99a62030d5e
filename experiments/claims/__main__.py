"""`python -m experiments.claims`: write the claims page."""
from experiments.claims.page import main

main()
