use super::*;

#[test]
fn component_levels_override_the_default_for_their_modules() {
    let mut l = Levels::new("warning");
    l.set_list("misc:error,upstream:debug,config:trace")
        .unwrap();
    let d = l.directives();
    assert!(d.starts_with("warn,portico=warn"), "{d}");
    for want in [
        "portico::lb=debug",
        "portico::live=debug",
        "portico::xds=trace",
    ] {
        assert!(d.contains(want), "{want} in {d}");
    }
    assert!(l.listing().contains("  misc: error\n"));
    assert!(l.listing().starts_with("active loggers:\n  a2a: warning\n"));
}

#[test]
fn a_bad_entry_changes_nothing() {
    let mut l = Levels::new("info");
    let before = l.clone();
    assert_eq!(
        l.set_list("admin:debug,nosuch:info"),
        Err(LevelError::UnknownLogger("nosuch".into()))
    );
    assert_eq!(
        l.set_list("admin:loud"),
        Err(LevelError::UnknownLevel("loud".into()))
    );
    assert_eq!(
        l.set_list("admin"),
        Err(LevelError::Malformed("admin".into()))
    );
    assert_eq!(l, before);
}

#[test]
fn set_all_and_critical() {
    let mut l = Levels::new("info");
    l.set_all("critical");
    assert!(l.loggers.iter().all(|(_, v)| *v == "critical"));
    assert!(l.directives().starts_with("warn,portico=error"));
    l.set_all("off");
    assert!(l.directives().starts_with("off,portico=off"));
    assert_eq!(level("WARN"), Some("warning"));
    assert_eq!(level("fatal"), None);
}
