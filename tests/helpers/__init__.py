"""Code the tests share that is not a fixture (fixtures live in tests/conftest.py). Test modules import it as
`helpers.<module>`: pytest puts tests/ on sys.path for them (the `prepend` import mode, tests/ being no
package), which is also how they import conftest. speculators_roundtrip.py beside these is a script that
another venv runs, not a module to import."""
