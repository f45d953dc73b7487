//! The time formats the metadata services use (see shared/PROTOCOLS.md).

use std::time::{Duration, SystemTime};

/// `2017-09-18T08:22:00Z`, `2017-09-18 08:22:00`, with or without `Z` or fractions: UTC.
pub(crate) fn parse_utc(s: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(s.trim()).ok()
}

/// Tencent's `2018-08-18 12:05:33`, which is in UTC+8 (Beijing time), not UTC.
pub(crate) fn parse_utc8(s: &str) -> Option<SystemTime> {
    parse_utc(s).map(|t| t - Duration::from_secs(8 * 3600))
}

/// Azure's RFC 1123 `Tue, 09 Aug 2022 17:07:32 GMT`.
pub(crate) fn parse_http_date(s: &str) -> Option<SystemTime> {
    httpdate::parse_http_date(s.trim()).ok()
}

/// AWS scheduled events' `21 Jan 2019 09:00:43 GMT` (no weekday); RFC 3339 is accepted too.
pub(crate) fn parse_aws_event_time(s: &str) -> Option<SystemTime> {
    let f: Vec<&str> = s.split_whitespace().collect();
    if let [day, mon, year, hms, "GMT" | "UTC"] = f.as_slice() {
        const MONTHS: [&str; 12] = [
            "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
        ];
        let m = MONTHS.iter().position(|x| x.eq_ignore_ascii_case(mon))? + 1;
        let day: u32 = day.parse().ok()?;
        return parse_utc(&format!("{year}-{m:02}-{day:02}T{hms}Z"));
    }
    parse_utc(s)
}

/// RFC 3339 in UTC, whole seconds.
pub(crate) fn format_utc(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> SystemTime {
        humantime::parse_rfc3339(s).expect("test time")
    }

    #[test]
    fn every_format() {
        assert_eq!(
            parse_utc("2017-09-18T08:22:00Z"),
            Some(at("2017-09-18T08:22:00Z"))
        );
        assert_eq!(
            parse_utc("2015-01-05 18:02:00"),
            Some(at("2015-01-05T18:02:00Z"))
        );
        assert_eq!(
            parse_utc8("2018-08-18 12:05:33"),
            Some(at("2018-08-18T04:05:33Z"))
        );
        assert_eq!(
            parse_http_date("Tue, 09 Aug 2022 17:07:32 GMT"),
            Some(at("2022-08-09T17:07:32Z"))
        );
        assert_eq!(
            parse_aws_event_time("21 Jan 2019 09:00:43 GMT"),
            Some(at("2019-01-21T09:00:43Z"))
        );
        assert_eq!(parse_utc("soon"), None);
        assert_eq!(parse_http_date(""), None);
    }
}
