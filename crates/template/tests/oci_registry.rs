//! Images from a real registry (Debian's `docker-registry` on loopback, images pushed with
//! `skopeo`) and from tarballs, made into templates. The images are made here from files of the
//! base template's rootfs: several layers, a whiteout and an opaque dir, one zstd layer, a
//! manifest list with an arm64 decoy listed first.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use common::fake_static_agent;
use common::oci::{config, sha, Layer, LayerTar, OciLayout};
use common::registry::{base_rootfs, runs_here, Registry};
use kiln_template::oci::template::fetch;
use kiln_template::oci::{
    build_from_image, Credentials, ImageBuildOptions, ImageSource, Mirrors, PullOptions,
};
use kiln_template::Store;

mod common;

const PASSWD: &[u8] = b"root:x:0:0:root:/root:/bin/bash\n";
const GROUP: &[u8] = b"root:x:0:\n";

/// Layer 1: bash and the C library from the base rootfs, an /etc without the user `user`.
fn base_layer() -> Layer {
    let root = base_rootfs();
    let wanted = [
        "bin",
        "lib",
        "lib64",
        "usr/bin/bash",
        "usr/lib/x86_64-linux-gnu/libc.so.6",
        "usr/lib/x86_64-linux-gnu/libtinfo.so.6",
        "usr/lib/x86_64-linux-gnu/libtinfo.so.6.4",
        "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
        "usr/lib64",
        "etc/skel",
    ];
    let present: Vec<&str> = wanted
        .iter()
        .copied()
        .filter(|p| root.join(p).symlink_metadata().is_ok())
        .collect();
    Layer::gzip(
        LayerTar::new()
            .tree(&root, &present)
            .file("etc/passwd", PASSWD, 0o644)
            .file("etc/group", GROUP, 0o644)
            .file("etc/gone", b"lower\n", 0o644)
            .file("opt/app/old/f", b"lower\n", 0o644)
            .finish(),
    )
}

/// Layer 2: a whiteout and an opaque dir.
fn whiteout_layer() -> Layer {
    Layer::gzip(
        LayerTar::new()
            .file("etc/.wh.gone", b"", 0o644)
            .file("opt/app/.wh..wh..opq", b"", 0o644)
            .file("opt/app/new", b"upper\n", 0o644)
            .finish(),
    )
}

/// Layer 3, zstd.
fn marker_layer(text: &str) -> Layer {
    Layer::zstd(
        LayerTar::new()
            .file("etc/image-marker", text.as_bytes(), 0o644)
            .finish(),
    )
}

struct Fixture {
    _tmp: tempfile::TempDir,
    store: Store,
    agent: PathBuf,
    layout: OciLayout,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(tmp.path().join("templates")).unwrap();
    let agent = fake_static_agent(tmp.path(), 0);
    let layout = OciLayout::create(&tmp.path().join("layout"));
    Fixture {
        _tmp: tmp,
        store,
        agent,
        layout,
    }
}

fn opts(f: &Fixture, pull: PullOptions) -> ImageBuildOptions {
    ImageBuildOptions {
        agent: Some(f.agent.clone()),
        force: false,
        quiet: true,
        pull,
    }
}

fn mirror(reg: &Registry) -> PullOptions {
    PullOptions {
        mirrors: Mirrors::parse(&[format!("docker.io=http://{}", reg.addr)]).unwrap(),
        quiet: true,
        ..Default::default()
    }
}

/// Pushes the three-layer image (with an arm64 decoy first in its manifest list) as `repo:tag`.
fn push_stacked(reg: &Registry, f: &Fixture, repo: &str, tag: &str) -> (Layer, Layer, Layer) {
    let (l1, l2, l3) = (base_layer(), whiteout_layer(), marker_layer("zstd layer\n"));
    let env = ["PATH=/usr/bin:/bin", "FOO=bar"];
    let amd64 = f.layout.image(
        &config("amd64", &env, "/srv/app", "", &[&l1, &l2, &l3]),
        &[&l1, &l2, &l3],
        "amd64",
    );
    let decoy_layer = marker_layer("arm64 decoy\n");
    let arm64 = f.layout.image(
        &config("arm64", &env, "/", "", &[&decoy_layer]),
        &[&decoy_layer],
        "arm64",
    );
    let index = f.layout.index(&[arm64, amd64]);
    f.layout.tag(&index, tag);
    reg.push(&f.layout.dir, tag, repo, &["--all"]);
    (l1, l2, l3)
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn assert_nothing_cached(store: &Store) {
    for d in [".tmp", ".base"] {
        let left: Vec<_> = std::fs::read_dir(store.root().join(d))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .collect();
        assert!(left.is_empty(), "{d} holds {left:?} after a failed build");
    }
}

#[test]
fn image_through_mirror_becomes_a_template() {
    if !runs_here() {
        return;
    }
    let reg = Registry::start(None);
    let f = fixture();
    push_stacked(&reg, &f, "library/testimg", "1");
    // `testimg:1` is a Docker Hub name: the mirror answers for docker.io.
    let out = build_from_image(
        &f.store,
        &ImageSource::Registry("testimg:1".into()),
        None,
        &opts(&f, mirror(&reg)),
    )
    .unwrap();
    let t = &out.template;
    assert!(!out.cached);
    assert_eq!(t.name, "testimg-1");
    let r = &t.rootfs;
    assert_eq!(
        read(&r.join("etc/image-marker")),
        "zstd layer\n",
        "linux/amd64 not chosen or zstd layer not applied"
    );
    assert!(!r.join("etc/gone").exists(), "whiteout not applied");
    assert!(!r.join("opt/app/old").exists(), "opaque dir not applied");
    assert_eq!(read(&r.join("opt/app/new")), "upper\n");
    assert!(r.join("usr/bin/bash").is_file());
    // What kiln adds.
    assert!(read(&r.join("etc/passwd")).contains("user:x:1000:1000::/home/user:/bin/bash"));
    assert_eq!(
        std::fs::read_link(r.join("usr/bin/sudo")).unwrap(),
        Path::new("kiln-agent")
    );
    assert!(read(&r.join("etc/sudoers.d/kiln-user")).contains("user ALL=(ALL:ALL) NOPASSWD: ALL"));
    assert!(r.join("usr/bin/kiln-agent").is_file());
    assert_eq!(r.join("home/user").metadata().unwrap().uid(), 1000);
    assert!(t.ext4.is_file());
    // The image config.
    assert_eq!((t.user.as_str(), t.workdir.as_str()), ("user", "/srv/app"));
    assert!(r.join("srv/app").is_dir());
    assert_eq!(t.env["FOO"], "bar");
    assert_eq!(t.env["PATH"], "/usr/bin:/bin");
    // The lookup `Sandbox.create("testimg-1")` does finds it.
    assert_eq!(f.store.lookup("testimg-1").unwrap().key, t.key);
    let again = build_from_image(
        &f.store,
        &ImageSource::Registry("testimg:1".into()),
        None,
        &opts(&f, mirror(&reg)),
    )
    .unwrap();
    assert!(
        again.cached,
        "a second build of the same image must be a cache hit"
    );

    // gc keeps the blobs of cached image stages and removes the rest.
    let blobs = kiln_template::oci::template::blobs_of(&f.store).unwrap();
    let stray_src = f._tmp.path().join("stray");
    std::fs::write(&stray_src, b"unreferenced").unwrap();
    let stray = blobs.import_file(&stray_src, None).unwrap();
    let removed = kiln_template::oci::template::gc_blobs(&f.store).unwrap();
    assert_eq!(removed, vec![blobs.path(&stray).unwrap()]);
    let stage: kiln_template::oci::Image = serde_json::from_slice(
        &std::fs::read(
            f.store
                .root()
                .join(".base")
                .join(&t.recipe_hash)
                .join("image.json"),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(stage.layers.len(), 3);
    assert!(stage.layers.iter().all(|l| blobs.has(&l.digest)));
}

#[test]
fn a_second_image_reuses_cached_layers() {
    if !runs_here() {
        return;
    }
    let reg = Registry::start(None);
    let f = fixture();
    let (l1, _, _) = push_stacked(&reg, &f, "library/first", "1");
    // The second image shares layer 1; Docker schema 2 manifest this time.
    let extra = Layer::gzip(LayerTar::new().file("etc/second", b"2\n", 0o644).finish());
    let m = f.layout.image(
        &config("amd64", &[], "", "", &[&l1, &extra]),
        &[&l1, &extra],
        "amd64",
    );
    f.layout.tag(&m, "2");
    reg.push(&f.layout.dir, "2", "team/second", &["--format", "v2s2"]);

    let first = fetch(
        &f.store,
        &ImageSource::Registry("first:1".into()),
        &mirror(&reg),
    )
    .unwrap();
    assert_eq!(first.layers.len(), 3);
    let blobs = kiln_template::oci::template::blobs_of(&f.store).unwrap();
    let shared = blobs.path(&first.layers[0].digest).unwrap();
    let inode = shared.metadata().unwrap().ino();
    // By its full loopback name (plain HTTP), no mirror.
    let second = fetch(
        &f.store,
        &ImageSource::Registry(format!("{}/team/second:2", reg.addr)),
        &PullOptions {
            quiet: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(second.layers[0].digest, first.layers[0].digest);
    assert_eq!(
        shared.metadata().unwrap().ino(),
        inode,
        "the shared layer was fetched again"
    );
    assert!(blobs.has(&second.layers[1].digest));
    assert_eq!(second.layers[1].diff_id, extra.diff_id);
    assert_ne!(second.digest, first.digest);
}

#[test]
fn basic_auth_and_wrong_credentials() {
    if !runs_here() {
        return;
    }
    let reg = Registry::start(Some(("kiln", "s3cret")));
    let f = fixture();
    let l = marker_layer("auth\n");
    let m = f
        .layout
        .image(&config("amd64", &[], "", "", &[&l]), &[&l], "amd64");
    f.layout.tag(&m, "1");
    reg.push(&f.layout.dir, "1", "private/img", &[]);
    let name = ImageSource::Registry(format!("{}/private/img:1", reg.addr));
    let with = |user: &str, password: &str| PullOptions {
        credentials: Some(Credentials {
            user: user.into(),
            password: password.into(),
        }),
        quiet: true,
        ..Default::default()
    };
    let img = fetch(&f.store, &name, &with("kiln", "s3cret")).unwrap();
    assert_eq!(img.layers[0].digest, sha(&l.blob));

    let e = fetch(&f.store, &name, &with("kiln", "wrong"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&reg.addr) && e.contains("refused the credentials of user \"kiln\""),
        "{e}"
    );
    assert!(e.contains("--registry-password"), "{e}");
    assert!(!e.contains("wrong"), "the password must not be echoed: {e}");
    let e = fetch(
        &f.store,
        &name,
        &PullOptions {
            quiet: true,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("refused anonymous access"), "{e}");
}

#[test]
fn unknown_image_or_tag_names_the_image_and_the_registry_answer() {
    if !runs_here() {
        return;
    }
    let reg = Registry::start(None);
    let f = fixture();
    let l = marker_layer("x\n");
    let m = f
        .layout
        .image(&config("amd64", &[], "", "", &[&l]), &[&l], "amd64");
    f.layout.tag(&m, "1");
    reg.push(&f.layout.dir, "1", "library/known", &[]);
    let e = fetch(
        &f.store,
        &ImageSource::Registry("known:nope".into()),
        &mirror(&reg),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("docker.io/library/known:nope") && e.contains(&reg.addr),
        "{e}"
    );
    assert!(e.contains("MANIFEST_UNKNOWN"), "{e}");
    let e = fetch(
        &f.store,
        &ImageSource::Registry("nosuch/image:1".into()),
        &mirror(&reg),
    )
    .unwrap_err()
    .to_string();
    // distribution 2.8 answers MANIFEST_UNKNOWN for an unknown repository, later ones NAME_UNKNOWN.
    assert!(
        e.contains("docker.io/nosuch/image:1") && e.contains("_UNKNOWN"),
        "{e}"
    );
}

#[test]
fn hostile_or_bashless_images_fail_and_cache_nothing() {
    if !runs_here() {
        return;
    }
    let reg = Registry::start(None);
    let f = fixture();
    let cases: Vec<(&str, Layer, &str)> = vec![
        (
            "dotdot",
            Layer::gzip(LayerTar::new().file("../../escape", b"x", 0o644).finish()),
            "is refused",
        ),
        (
            "symlink",
            Layer::gzip(
                LayerTar::new()
                    .symlink("etc/up", "../../../escape")
                    .finish(),
            ),
            "leads out of the root",
        ),
        (
            "no-bash",
            Layer::gzip(LayerTar::new().file("etc/passwd", PASSWD, 0o644).finish()),
            "has no /bin/bash",
        ),
    ];
    for (tag, layer, want) in cases {
        let m = f
            .layout
            .image(&config("amd64", &[], "", "", &[&layer]), &[&layer], "amd64");
        f.layout.tag(&m, tag);
        reg.push(&f.layout.dir, tag, "library/bad", &[]);
        let e = build_from_image(
            &f.store,
            &ImageSource::Registry(format!("bad:{tag}")),
            None,
            &opts(&f, mirror(&reg)),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains(want), "{tag}: {e}");
        assert_nothing_cached(&f.store);
    }
}

#[test]
fn docker_save_and_oci_layout_tarballs_import() {
    if !runs_here() {
        return;
    }
    let f = fixture();
    let dir = f._tmp.path();
    // Classic `docker save`: manifest.json, <hex>.json config, <id>/layer.tar (uncompressed),
    // a duplicate layer as a symlink.
    let l1 = LayerTar::new()
        .tree(&base_rootfs(), &["bin", "usr/bin/bash"])
        .file("etc/passwd", PASSWD, 0o644)
        .file("etc/group", GROUP, 0o644)
        .finish();
    let l2 = LayerTar::new()
        .file("etc/image-marker", b"saved\n", 0o644)
        .finish();
    let (p1, p2) = (Layer::plain(l1.clone()), Layer::plain(l2.clone()));
    let cfg = config("amd64", &["SAVED=1"], "", "root", &[&p1, &p2, &p2]);
    let cfg_name = format!("{}.json", &sha(&cfg)[7..]);
    let manifest = serde_json::json!([{"Config": cfg_name, "RepoTags": ["saved:1"], "Layers": ["a/layer.tar", "b/layer.tar", "c/layer.tar"]}]);
    let save = dir.join("saved.tar");
    {
        let mut b = tar::Builder::new(std::fs::File::create(&save).unwrap());
        let mut add = |name: &str, bytes: &[u8]| {
            let mut h = tar::Header::new_gnu();
            h.set_size(bytes.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, name, bytes).unwrap();
        };
        add("manifest.json", &serde_json::to_vec(&manifest).unwrap());
        add(&cfg_name, &cfg);
        add("a/layer.tar", &l1);
        add("b/layer.tar", &l2);
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        h.set_cksum();
        b.append_link(&mut h, "c/layer.tar", "../b/layer.tar")
            .unwrap();
        b.finish().unwrap();
    }
    let out = build_from_image(
        &f.store,
        &ImageSource::Archive(save),
        None,
        &opts(&f, PullOptions::default()),
    )
    .unwrap();
    let t = out.template;
    assert_eq!(t.name, "saved");
    assert_eq!(read(&t.rootfs.join("etc/image-marker")), "saved\n");
    assert_eq!((t.user.as_str(), t.workdir.as_str()), ("root", "/root"));
    assert_eq!(t.env["SAVED"], "1");

    // An OCI layout tarball (what `skopeo copy … oci-archive:` and Docker 25+ write).
    let l3 = Layer::zstd(
        LayerTar::new()
            .file("etc/image-marker", b"oci layout\n", 0o644)
            .finish(),
    );
    let p1z = Layer::gzip(l1);
    let m = f.layout.image(
        &config("amd64", &[], "", "", &[&p1z, &l3]),
        &[&p1z, &l3],
        "amd64",
    );
    f.layout.tag(&m, "latest");
    let archive = dir.join("layout.tar");
    f.layout.tarball(&archive);
    let out = build_from_image(
        &f.store,
        &ImageSource::Archive(archive),
        Some("from-layout"),
        &opts(&f, PullOptions::default()),
    )
    .unwrap();
    assert_eq!(
        read(&out.template.rootfs.join("etc/image-marker")),
        "oci layout\n"
    );
    assert_eq!(out.template.user, "user");
    // A tarball that is neither says so.
    let junk = dir.join("junk.tar");
    LayerTar::new().file("x", b"x", 0o644).finish();
    std::fs::write(&junk, LayerTar::new().file("x", b"x", 0o644).finish()).unwrap();
    let e = build_from_image(
        &f.store,
        &ImageSource::Archive(junk),
        None,
        &opts(&f, PullOptions::default()),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("neither an OCI image layout"), "{e}");
}

#[test]
fn bearer_tokens_anonymous_and_with_credentials() {
    if !runs_here() {
        return;
    }
    let f = fixture();
    let tokens = common::token::TokenServer::start(f._tmp.path(), "kiln", "s3cret");
    let reg = Registry::start_token(tokens.registry_auth(), ("kiln", "s3cret"));
    let l = marker_layer("token\n");
    let m = f
        .layout
        .image(&config("amd64", &[], "", "", &[&l]), &[&l], "amd64");
    f.layout.tag(&m, "1");
    reg.push(&f.layout.dir, "1", "library/tok", &[]);
    // Anonymous: the registry's 401 names the realm; kiln asks it for an anonymous pull token.
    let img = fetch(
        &f.store,
        &ImageSource::Registry("tok:1".into()),
        &mirror(&reg),
    )
    .unwrap();
    assert_eq!(img.layers[0].digest, sha(&l.blob));
    let with = |password: &str| PullOptions {
        credentials: Some(Credentials {
            user: "kiln".into(),
            password: password.into(),
        }),
        ..mirror(&reg)
    };
    fetch(
        &f.store,
        &ImageSource::Registry("tok:1".into()),
        &with("s3cret"),
    )
    .unwrap();
    let e = fetch(
        &f.store,
        &ImageSource::Registry("tok:1".into()),
        &with("wrong"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("refused the credentials of user \"kiln\"") && e.contains("incorrect username"),
        "{e}"
    );
}
