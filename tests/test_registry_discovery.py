"""Backends register themselves: the registry imports no backend module, so adding a backend is adding
one ``kernels/<name>_backend.py`` (``registry.import_backend_modules``, called by the package's
``__init__``, imports every such module; each calls ``register_backend`` at import)."""
import ast
import pathlib

from gdn_layer.kernels import available_backends, registry

KERNELS = pathlib.Path(registry.__file__).parent


def test_registry_imports_no_backend_module():
    tree = ast.parse((KERNELS / "registry.py").read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names] + [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m.endswith("_backend")], imported


def test_every_backend_module_is_imported_and_registers_itself():
    files = sorted(p.stem for p in KERNELS.glob("*_backend.py"))
    assert registry.import_backend_modules() == files
    assert {"fla", "flash_qla", "torch"} <= set(available_backends())
    for name in available_backends():
        b = registry.backend_by_name(name)
        if name != "torch":       # the reference is the registry's own
            assert b.chunk_gated_delta_rule.__module__.rsplit(".", 1)[-1] in files, name
